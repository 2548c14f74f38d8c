package repo

import (
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// LastCommit returns the revision and time of HEAD of the checkout at root;
// builds that must be reproducible stamp their files with that time.
func LastCommit(root string) (revision string, at time.Time, err error) {
	c := exec.Command("git", "log", "-1", "--format=%H %ct")
	c.Dir = root
	out, err := c.Output()
	if err != nil {
		return "", time.Time{}, fmt.Errorf("reading the last commit: %w", err)
	}
	fields := strings.Fields(string(out))
	if len(fields) != 2 {
		return "", time.Time{}, fmt.Errorf("reading the last commit: unexpected git log output %q", out)
	}
	secs, err := strconv.ParseInt(fields[1], 10, 64)
	if err != nil {
		return "", time.Time{}, fmt.Errorf("reading the last commit: %w", err)
	}
	return fields[0], time.Unix(secs, 0).UTC(), nil
}
