package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// waitFor asks ready every 200 ms until it answers nil; when ctx ends first,
// the error names the component and its last answer.
func waitFor(ctx context.Context, name string, ready func(context.Context) error) error {
	var err error
	for {
		if err = ready(ctx); err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s did not become ready: %w", name, err)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// httpReady answers whether url answers 200; TLS is not verified (the
// components' own self-signed serving certificates).
func httpReady(url string, cert *tls.Certificate) func(context.Context) error {
	tlsConfig := &tls.Config{InsecureSkipVerify: true}
	if cert != nil {
		tlsConfig.Certificates = []tls.Certificate{*cert}
	}
	client := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{TLSClientConfig: tlsConfig}}
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s answered %s", url, resp.Status)
		}
		return nil
	}
}

func (c *cluster) apiReady(ctx context.Context) error {
	cert, err := tls.LoadX509KeyPair(c.path("pki", "admin.crt"), c.path("pki", "admin.key"))
	if err != nil {
		return err
	}
	return httpReady("https://"+nodeIP+":"+apiPort+"/readyz", &cert)(ctx)
}

func (c *cluster) clientset() (*kubernetes.Clientset, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", c.path("admin.kubeconfig"))
	if err != nil {
		return nil, err
	}
	cfg.Timeout = 10 * time.Second
	return kubernetes.NewForConfig(cfg)
}

// defaultServiceAccount waits until the controller manager has created the
// default namespace's service account, without which no pod is admitted.
func (c *cluster) defaultServiceAccount(ctx context.Context) error {
	cs, err := c.clientset()
	if err != nil {
		return err
	}
	return waitFor(ctx, "the default service account", func(ctx context.Context) error {
		_, err := cs.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	})
}
