package app

import (
	"context"
	"errors"
	"strings"

	"tally.dev/tally/pkg/config"
)

// configCheck reads tally's configuration (the chart's ConfigMap, or --config),
// which the checks after it follow.
type configCheck struct{}

func (configCheck) name() string { return "config" }

func (c configCheck) run(ctx context.Context, d *doctor) Check {
	cfg, err := d.config(ctx, d.cs)
	var invalid *config.InvalidError
	switch {
	case errors.As(err, &invalid):
		return fail(c.name(), "fix the configuration (the aggregator refuses it at start-up, and the webhook too; helm install and upgrade refuse it): see docs/configuration.md", "%v", err)
	case err != nil:
		return fail(c.name(), "install the chart, or name its release with --release and --tally-namespace", "%v", err)
	}
	var kinds []string
	for _, p := range cfg.Parents {
		kinds = append(kinds, p.GroupKind().String())
	}
	from := d.configFile
	if from == "" {
		from = "ConfigMap " + d.tallyNamespace + "/" + d.configMapName()
	}
	d.cfg = cfg
	if err := errors.Join(cfg.CustomCountErrors(), cfg.CompareErrors()); err != nil {
		return fail(c.name(), "fix these custom counts and comparisons (helm install and upgrade refuse them): see docs/configuration.md",
			"%s: the aggregator leaves these custom counts unwritten and these comparisons out, and serves everything else: %v", from, err)
	}
	return ok(c.name(), "%s: parent kinds %s, verifyOwner %t", from, strings.Join(kinds, ", "), cfg.VerifyOwner)
}
