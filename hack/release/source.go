package main

import (
	"fmt"
	"os/exec"
	"slices"
	"strings"
)

// checkSource reports whether the checkout at root may be released as
// version: its tree is clean (nothing modified, staged or untracked that
// git does not ignore) and HEAD carries the tag v<version>. A release is
// what the tag names, so a build from anything else would publish files
// nobody can rebuild; a snapshot (make release SNAPSHOT=true, the release
// test) skips both checks.
func checkSource(root, version string) error {
	status, err := git(root, "status", "--porcelain", "--untracked-files=normal")
	if err != nil {
		return err
	}
	if status != "" {
		lines := strings.Split(status, "\n")
		if len(lines) > 5 {
			lines = append(lines[:5], fmt.Sprintf("... and %d more", len(lines)-5))
		}
		return fmt.Errorf("the tree is not clean, a release would not be what any commit holds (commit or remove these, or SNAPSHOT=true for a build that is not a release):\n%s", strings.Join(lines, "\n"))
	}
	tags, err := git(root, "tag", "--points-at", "HEAD")
	if err != nil {
		return err
	}
	tag := "v" + version
	if !slices.Contains(strings.Fields(tags), tag) {
		return fmt.Errorf("HEAD does not carry the tag %s: tag the commit to release (git tag %s), or SNAPSHOT=true for a build that is not a release", tag, tag)
	}
	return nil
}

// git runs git in dir and returns its output without the final newline.
func git(dir string, args ...string) (string, error) {
	c := exec.Command("git", args...)
	c.Dir = dir
	out, err := c.Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return "", fmt.Errorf("git %s: %w: %s", args[0], err, strings.TrimSpace(string(ee.Stderr)))
		}
		return "", fmt.Errorf("git %s: %w", args[0], err)
	}
	return strings.TrimRight(string(out), "\n"), nil
}
