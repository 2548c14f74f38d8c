package main

import (
	"fmt"
	"regexp"
	"strings"
)

// semverRE matches a semantic version without a leading v (semver.org's
// expression, without build metadata).
var semverRE = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-((0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?$`)

// headingRE matches a release's heading in CHANGELOG.md: ## [x.y.z] - date,
// or - Unreleased for a version not yet tagged (the release workflow
// refuses to publish it until the section is dated).
var headingRE = regexp.MustCompile(`^## \[([^\]]+)\] - (\d{4}-\d{2}-\d{2}|Unreleased)\s*$`)

// checkVersion reports whether v is a version a release can have.
func checkVersion(v string) error {
	if !semverRE.MatchString(v) {
		return fmt.Errorf("VERSION %q is not a semantic version x.y.z[-pre] (no leading v)", v)
	}
	return nil
}

// releaseNotes returns the text of the newest section of the changelog,
// which must be version's.
func releaseNotes(changelog, version string) (string, error) {
	lines := strings.Split(changelog, "\n")
	start := -1
	for i, l := range lines {
		if !strings.HasPrefix(l, "## ") {
			continue
		}
		if start >= 0 {
			return section(lines[start:i], version)
		}
		m := headingRE.FindStringSubmatch(l)
		if m == nil {
			return "", fmt.Errorf("CHANGELOG.md: the newest section's heading %q is not \"## [x.y.z] - YYYY-MM-DD\" (or \"- Unreleased\")", l)
		}
		if m[1] != version {
			return "", fmt.Errorf("CHANGELOG.md: the newest section is %s, not %s: add a section \"## [%s] - YYYY-MM-DD\" with the release's notes", m[1], version, version)
		}
		start = i + 1
	}
	if start < 0 {
		return "", fmt.Errorf("CHANGELOG.md has no section: add \"## [%s] - YYYY-MM-DD\" with the release's notes", version)
	}
	return section(lines[start:], version)
}

func section(lines []string, version string) (string, error) {
	text := strings.TrimSpace(strings.Join(lines, "\n"))
	if text == "" {
		return "", fmt.Errorf("CHANGELOG.md: the section of %s is empty: write the release's notes in it", version)
	}
	return text + "\n", nil
}
