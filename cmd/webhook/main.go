// Command webhook is tally's mutating admission webhook for pods: it stamps
// each pod with its parent's identity and records completion intent.
package main

import (
	"flag"
	"os"
	"time"

	ctrl "sigs.k8s.io/controller-runtime"

	"tally.dev/tally/cmd/webhook/app"
	"tally.dev/tally/internal/command"
)

func main() {
	var common command.Common
	opts := app.Options{}
	common.Bind(flag.CommandLine, ":8080")
	flag.StringVar(&opts.CertDir, "cert-dir", "/tmp/k8s-webhook-server/serving-certs", "Directory holding tls.crt and tls.key; reloaded when they change.")
	flag.IntVar(&opts.Port, "port", 9443, "Port the webhook serves TLS on.")
	flag.StringVar(&opts.Host, "host", "", "Address the webhook listens on; empty for all.")
	flag.DurationVar(&opts.ShutdownDelay, "shutdown-delay", 5*time.Second, "After SIGTERM, keep serving this long (reporting not ready, closing each connection after its answer) while the Service's endpoints drop this replica, so that no admission is refused during a rollout or a drain.")
	command.Main("webhook", func() error {
		if common.CheckConfig {
			return common.Check(os.Stdout)
		}
		cfg, restCfg, err := common.Setup()
		if err != nil {
			return err
		}
		opts.MetricsAddr, opts.ProbeAddr, opts.MetricsSecure = common.MetricsAddr, common.ProbeAddr, common.MetricsSecure
		return app.Run(ctrl.SetupSignalHandler(), cfg, restCfg, opts)
	})
}
