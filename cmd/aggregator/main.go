// Command aggregator keeps each parent's configured status fields equal to
// the counts of its pods, written with server-side apply under the field
// manager "tally-aggregator".
package main

import (
	"flag"
	"os"

	ctrl "sigs.k8s.io/controller-runtime"

	"tally.dev/tally/cmd/aggregator/app"
	"tally.dev/tally/internal/command"
	"tally.dev/tally/pkg/aggregate"
)

func main() {
	var common command.Common
	opts := app.Options{}
	common.Bind(flag.CommandLine, ":8080")
	flag.BoolVar(&opts.LeaderElect, "leader-elect", false, "Elect one active replica through a Lease, so that several replicas can run.")
	flag.StringVar(&opts.LeaderElectionNamespace, "leader-election-namespace", "", "Namespace of the leader election Lease; the pod's own namespace when empty.")
	flag.StringVar(&opts.LeaderElectionID, "leader-election-id", app.DefaultLeaderElectionID, "Name of the leader election Lease; replicas of one installation must share it, two installations in one namespace must not.")
	flag.DurationVar(&opts.BackfillInterval, "backfill-interval", app.DefaultBackfillInterval, "Time between two sweeps that stamp the pods the webhook never saw (created before tally, or while the webhook was unreachable); one also runs at start-up, before the first status write.")
	flag.DurationVar(&opts.TrackingGrace, "tracking-grace", aggregate.DefaultTrackingGrace, "How long a finished pod of a kind with totals may wait to be recorded before its tracking finalizer is removed anyway (it is then missing from the totals, counted in tally_aggregator_tracking_lost_pods_total).")
	qps := flag.Float64("kube-api-qps", 50, "Requests per second the aggregator may send to the API server (status applies, and pod stamps during a backfill sweep).")
	flag.IntVar(&opts.Burst, "kube-api-burst", 100, "Requests the aggregator may send to the API server in a burst above --kube-api-qps.")
	flag.StringVar(&opts.ContentType, "kube-api-content-type", "protobuf", "How pods are read from the API server: protobuf, or json (for a proxy in between that only passes JSON).")
	flag.IntVar(&opts.MaxConcurrentReconciles, "max-concurrent-reconciles", 4, "How many parents of one kind are reconciled at once; one parent is never reconciled twice at once.")
	command.Main("aggregator", func() error {
		if common.CheckConfig {
			// The flags the chart passes too: a value the aggregator
			// refuses at start is refused before anything changes.
			if err := opts.Validate(); err != nil {
				return err
			}
			return common.Check(os.Stdout)
		}
		cfg, restCfg, err := common.Setup()
		if err != nil {
			return err
		}
		opts.MetricsAddr, opts.ProbeAddr, opts.MetricsSecure = common.MetricsAddr, common.ProbeAddr, common.MetricsSecure
		opts.QPS = float32(*qps)
		return app.Run(ctrl.SetupSignalHandler(), cfg, restCfg, opts)
	})
}
