// Command curl is the part of curl that Kubernetes' conformance tests use in
// the agnhost image (whose upstream base, Alpine, has curl): one GET of each
// URL given, the body to standard output, and a non-zero exit status when a
// request fails or answers with a status of 400 or more. Flags (-s, -f, ...)
// are accepted and ignored.
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

func main() {
	client := &http.Client{Timeout: 30 * time.Second}
	status := 0
	for _, arg := range os.Args[1:] {
		if strings.HasPrefix(arg, "-") {
			continue
		}
		url := arg
		if !strings.Contains(url, "://") {
			url = "http://" + url
		}
		if err := get(client, url); err != nil {
			fmt.Fprintln(os.Stderr, "curl:", err)
			status = 1
		}
	}
	os.Exit(status)
}

func get(client *http.Client, url string) error {
	resp, err := client.Get(url)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(os.Stdout, resp.Body); err != nil {
		return err
	}
	if resp.StatusCode >= 400 {
		return fmt.Errorf("%s: %s", url, resp.Status)
	}
	return nil
}
