// Package app is the kubectl-tally plugin: `kubectl tally explain` says why a
// parent shows the counts it shows, `kubectl tally doctor` checks an
// installation end to end, `kubectl tally finalizers remove` releases the
// pods tally tracks after it is uninstalled.
package app

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/cli-runtime/pkg/genericiooptions"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/metadata"
	"k8s.io/client-go/rest"
	"sigs.k8s.io/yaml"

	"tally.dev/tally/internal/version"
	"tally.dev/tally/pkg/config"
)

// Exit codes: scripts can tell a problem found from a failure to look.
const (
	// ExitOK: explain found the counts equal; doctor found every check OK.
	ExitOK = 0
	// ExitError: the command could not do its work (bad flags, API errors).
	ExitError = 1
	// ExitProblem: explain found a count that differs; doctor a check that
	// failed.
	ExitProblem = 3
)

// errProblem is returned by a command that ran and found a problem; it has
// already printed it.
var errProblem = errors.New("problem found")

// options are the flags every command shares.
type options struct {
	flags   *genericclioptions.ConfigFlags
	streams genericiooptions.IOStreams
	// release and tallyNamespace find the installation (chart release and
	// its namespace); configFile, when set, replaces its ConfigMap.
	release, tallyNamespace, configFile string
	// qps and burst, when positive, replace client-go's request rate (5
	// a second, bursts of 10).
	qps   float32
	burst int
}

// restConfig is the kubeconfig's, at the rate asked for.
func (o *options) restConfig() (*rest.Config, error) {
	cfg, err := o.flags.ToRESTConfig()
	if err != nil {
		return nil, err
	}
	if o.qps > 0 {
		cfg.QPS = o.qps
	}
	if o.burst > 0 {
		cfg.Burst = o.burst
	}
	return cfg, nil
}

// Main runs the plugin with args (without the program name) and returns its
// exit code.
func Main(args []string, streams genericiooptions.IOStreams) int {
	// SIGTERM (a Job's deadline, a deleted pod) and SIGINT cancel the
	// command's context, so that a command stopped part-way can undo what
	// it must not leave half done.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cmd := NewCommand(streams)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(ctx)
	switch {
	case err == nil:
		return ExitOK
	case errors.Is(err, errProblem):
		return ExitProblem
	default:
		fmt.Fprintln(streams.ErrOut, "error:", err)
		return ExitError
	}
}

// NewCommand returns the root command.
func NewCommand(streams genericiooptions.IOStreams) *cobra.Command {
	o := &options{flags: genericclioptions.NewConfigFlags(true), streams: streams}
	cmd := &cobra.Command{
		Use:   "kubectl-tally",
		Short: "Explain tally's counts and check a tally installation",
		Long: `kubectl tally explains the counts tally writes to a parent's status, checks an installation, and
removes tally's tracking finalizer from pods after an uninstall.

Exit status: 0 when all is well, 3 when explain finds a count that differs or doctor a check that fails,
1 when the command could not look.`,
		Annotations:   map[string]string{cobra.CommandDisplayNameAnnotation: "kubectl tally"},
		Version:       version.String(),
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	cmd.SetOut(streams.Out)
	cmd.SetErr(streams.ErrOut)
	o.flags.AddFlags(cmd.PersistentFlags())
	cmd.PersistentFlags().StringVar(&o.release, "release", "tally", "the Helm release of tally's chart")
	cmd.PersistentFlags().StringVar(&o.tallyNamespace, "tally-namespace", "tally-system", "the namespace tally is installed in")
	cmd.PersistentFlags().StringVar(&o.configFile, "config", "", "read tally's configuration from this file instead of the installed ConfigMap")
	cmd.AddCommand(newExplainCommand(o), newDoctorCommand(o), newFinalizersCommand(o))
	return cmd
}

// namespace is the namespace of -n, else of the kubeconfig's context.
func (o *options) namespace() (string, error) {
	ns, _, err := o.flags.ToRawKubeConfigLoader().Namespace()
	return ns, err
}

func (o *options) clients() (kubernetes.Interface, dynamic.Interface, error) {
	cfg, err := o.restConfig()
	if err != nil {
		return nil, nil, err
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, nil, err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	return cs, dyn, err
}

// metadataClient returns a client that reads objects' metadata only.
func (o *options) metadataClient() (metadata.Interface, error) {
	cfg, err := o.restConfig()
	if err != nil {
		return nil, err
	}
	return metadata.NewForConfig(cfg)
}

// configMapName is the chart's ConfigMap holding config.yaml.
func (o *options) configMapName() string { return o.release + "-config" }

// config reads tally's configuration: --config, else the installed
// ConfigMap.
func (o *options) config(ctx context.Context, cs kubernetes.Interface) (*config.Config, error) {
	if o.configFile != "" {
		return config.Load(o.configFile)
	}
	cm, err := cs.CoreV1().ConfigMaps(o.tallyNamespace).Get(ctx, o.configMapName(), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("ConfigMap %s/%s not found: is tally installed? Name its release with --release and --tally-namespace, or give --config FILE", o.tallyNamespace, o.configMapName())
	}
	if err != nil {
		return nil, fmt.Errorf("reading tally's configuration: %w", err)
	}
	data, ok := cm.Data["config.yaml"]
	if !ok {
		return nil, fmt.Errorf("ConfigMap %s/%s has no config.yaml", o.tallyNamespace, o.configMapName())
	}
	cfg, err := config.Parse([]byte(data))
	if err != nil {
		return nil, fmt.Errorf("ConfigMap %s/%s: %w", o.tallyNamespace, o.configMapName(), err)
	}
	return cfg, nil
}

// printStructured prints v as JSON or YAML.
func printStructured(o *options, format string, v any) error {
	var b []byte
	var err error
	if format == "json" {
		b, err = json.MarshalIndent(v, "", "  ")
		b = append(b, '\n')
	} else {
		b, err = yaml.Marshal(v)
	}
	if err != nil {
		return err
	}
	_, err = o.streams.Out.Write(b)
	return err
}

func checkOutput(format string) error {
	switch format {
	case "table", "json", "yaml":
		return nil
	}
	return fmt.Errorf("--output %q: use table, json or yaml", format)
}
