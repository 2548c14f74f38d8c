package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/keys"
	"tally.dev/tally/pkg/mutate"
)

// Check is one doctor check's result.
type Check struct {
	Name string `json:"name"`
	// Result is OK, FAIL, or SKIP (a check that depends on a failed one).
	Result string `json:"result"`
	Detail string `json:"detail"`
	// Fix says what to do about a FAIL.
	Fix string `json:"fix,omitempty"`
}

// The check results.
const (
	OK   = "OK"
	FAIL = "FAIL"
	SKIP = "SKIP"
)

// leaseStale is how old the aggregator's lease renewal may be: twice the
// lease duration.
const leaseStale = 30 * time.Second

// trackingStuck is how long a finished pod may keep the tracking finalizer:
// the aggregator releases it seconds after it finished (a leader failover
// or a burst held back by the client's QPS takes well under a minute).
const trackingStuck = 2 * time.Minute

// maxStatusReads bounds the terminal pods carrying the tracking finalizer
// whose status doctor reads to learn when they finished.
const maxStatusReads = 200

func newDoctorCommand(o *options) *cobra.Command {
	var output string
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check a tally installation end to end, with a fix for each problem",
		Long: `Check a tally installation end to end: its configuration, the webhook's registration, certificate and
endpoints, the aggregator's lease, each parent kind (served, status subresource, every mapped field in the
CRD's schema), finished pods held by the tracking finalizer, the admission policies, and the permissions of
both service accounts.`,
		Example: `  kubectl tally doctor
  kubectl tally doctor --release tally --tally-namespace tally-system -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output); err != nil {
				return err
			}
			checks, err := o.doctor(cmd.Context())
			if err != nil {
				return err
			}
			if output == "table" {
				writeChecks(o.streams.Out, checks)
			} else if err := printStructured(o, output, checks); err != nil {
				return err
			}
			for _, c := range checks {
				if c.Result == FAIL {
					return errProblem
				}
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func writeChecks(out io.Writer, checks []Check) {
	for _, c := range checks {
		fmt.Fprintf(out, "%-4s  %s: %s\n", c.Result, c.Name, c.Detail)
		if c.Fix != "" {
			fmt.Fprintf(out, "      fix: %s\n", c.Fix)
		}
	}
}

// doctor runs the checks in order; a check that needs what a failed one
// provides is skipped.
func (o *options) doctor(ctx context.Context) ([]Check, error) {
	cs, dyn, err := o.clients()
	if err != nil {
		return nil, err
	}
	d := &doctor{options: o, cs: cs, dyn: dyn}
	cfg, c := d.checkConfig(ctx)
	d.add(c)
	mwc, c := d.checkRegistration(ctx, cfg)
	d.add(c)
	d.add(d.checkEndpoints(ctx, mwc))
	d.add(d.checkCertificate(ctx, mwc))
	d.add(d.checkLease(ctx))
	if cfg != nil {
		for _, p := range cfg.Parents {
			d.add(d.checkKind(ctx, p))
		}
	}
	d.add(d.checkTracking(ctx))
	d.add(d.checkPolicies(ctx))
	d.add(d.checkPermissions(ctx, cfg))
	return d.checks, nil
}

type doctor struct {
	*options
	cs     kubernetes.Interface
	dyn    dynamic.Interface
	checks []Check
}

func (d *doctor) add(c Check) { d.checks = append(d.checks, c) }

func ok(name, format string, args ...any) Check {
	return Check{Name: name, Result: OK, Detail: fmt.Sprintf(format, args...)}
}

func fail(name, fix, format string, args ...any) Check {
	return Check{Name: name, Result: FAIL, Detail: fmt.Sprintf(format, args...), Fix: fix}
}

func skip(name, why string) Check { return Check{Name: name, Result: SKIP, Detail: why} }

func (d *doctor) checkConfig(ctx context.Context) (*config.Config, Check) {
	cfg, err := d.config(ctx, d.cs)
	if err != nil {
		return nil, fail("config", "install the chart, or name its release with --release and --tally-namespace", "%v", err)
	}
	var kinds []string
	for _, p := range cfg.Parents {
		kinds = append(kinds, p.GroupKind().String())
	}
	from := d.configFile
	if from == "" {
		from = "ConfigMap " + d.tallyNamespace + "/" + d.configMapName()
	}
	return cfg, ok("config", "%s: parent kinds %s, verifyOwner %t", from, strings.Join(kinds, ", "), cfg.VerifyOwner)
}

// checkRegistration checks the MutatingWebhookConfiguration: present, with
// a CA bundle, and matching the configured kinds.
func (d *doctor) checkRegistration(ctx context.Context, cfg *config.Config) (*admissionregistrationv1.MutatingWebhook, Check) {
	const name = "webhook registration"
	mwc, err := d.cs.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, d.release, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, fail(name, "helm upgrade --install the chart: without the registration no pod is stamped",
			"MutatingWebhookConfiguration %s not found", d.release)
	}
	if err != nil {
		return nil, fail(name, "", "reading MutatingWebhookConfiguration %s: %v", d.release, err)
	}
	if len(mwc.Webhooks) == 0 {
		return nil, fail(name, "helm upgrade the chart", "MutatingWebhookConfiguration %s has no webhook", d.release)
	}
	wh := &mwc.Webhooks[0]
	if len(wh.ClientConfig.CABundle) == 0 {
		fix := "with certificates.mode=cert-manager, check that cert-manager's cainjector runs; otherwise helm upgrade the chart"
		return wh, fail(name, fix, "webhook %s has no caBundle: the API server cannot call it", wh.Name)
	}
	if cfg != nil {
		for _, want := range mutate.MatchConditions(cfg) {
			i := slices.IndexFunc(wh.MatchConditions, func(c admissionregistrationv1.MatchCondition) bool { return c.Name == want.Name })
			if i < 0 || wh.MatchConditions[i].Expression != want.Expression {
				return wh, fail(name, "helm upgrade the chart so that the registration and the ConfigMap come from the same values",
					"its match condition %s does not follow the configured parent kinds and verifyOwner", want.Name)
			}
		}
	}
	return wh, ok(name, "MutatingWebhookConfiguration %s: failurePolicy %s, %s", d.release, ptr.Deref(wh.FailurePolicy, ""), target(wh))
}

func target(wh *admissionregistrationv1.MutatingWebhook) string {
	if s := wh.ClientConfig.Service; s != nil {
		return fmt.Sprintf("Service %s/%s port %d", s.Namespace, s.Name, ptr.Deref(s.Port, 443))
	}
	return "URL " + ptr.Deref(wh.ClientConfig.URL, "")
}

// checkEndpoints checks that the webhook's Service has ready endpoints.
func (d *doctor) checkEndpoints(ctx context.Context, wh *admissionregistrationv1.MutatingWebhook) Check {
	const name = "webhook endpoints"
	if wh == nil {
		return skip(name, "no registration")
	}
	svc := wh.ClientConfig.Service
	if svc == nil {
		return ok(name, "reached at a URL, not through a Service")
	}
	ready, err := d.readyEndpoints(ctx, svc)
	if err != nil {
		return fail(name, "", "listing the endpoints of Service %s/%s: %v", svc.Namespace, svc.Name, err)
	}
	if len(ready) == 0 {
		return fail(name, fmt.Sprintf("kubectl -n %s get pods -l app.kubernetes.io/component=webhook; kubectl -n %s describe pods -l app.kubernetes.io/component=webhook", svc.Namespace, svc.Namespace),
			"Service %s/%s has no ready endpoint: under failurePolicy Fail every tracked pod is refused", svc.Namespace, svc.Name)
	}
	return ok(name, "Service %s/%s: %d ready endpoint(s)", svc.Namespace, svc.Name, len(ready))
}

// endpoint is a ready endpoint of a Service: a pod and the port it serves.
type endpoint struct {
	pod  string
	port int32
}

// readyEndpoints returns the ready endpoints of the Service's port the
// registration names.
func (d *doctor) readyEndpoints(ctx context.Context, ref *admissionregistrationv1.ServiceReference) ([]endpoint, error) {
	svc, err := d.cs.CoreV1().Services(ref.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	portName, found := "", false
	for _, p := range svc.Spec.Ports {
		if p.Port == ptr.Deref(ref.Port, 443) {
			portName, found = p.Name, true
		}
	}
	if !found {
		return nil, fmt.Errorf("the Service %s/%s has no port %d", ref.Namespace, ref.Name, ptr.Deref(ref.Port, 443))
	}
	slices, err := d.cs.DiscoveryV1().EndpointSlices(ref.Namespace).List(ctx, metav1.ListOptions{LabelSelector: discoveryv1.LabelServiceName + "=" + ref.Name})
	if err != nil {
		return nil, err
	}
	var ready []endpoint
	for _, s := range slices.Items {
		for _, port := range s.Ports {
			if ptr.Deref(port.Name, "") != portName || port.Port == nil {
				continue
			}
			for _, e := range s.Endpoints {
				if ptr.Deref(e.Conditions.Ready, false) && e.TargetRef != nil && e.TargetRef.Kind == "Pod" {
					ready = append(ready, endpoint{pod: e.TargetRef.Name, port: *port.Port})
				}
			}
		}
	}
	return ready, nil
}

// checkCertificate connects to the webhook as the API server would and
// verifies the certificate it presents with the registration's caBundle.
func (d *doctor) checkCertificate(ctx context.Context, wh *admissionregistrationv1.MutatingWebhook) Check {
	const name = "webhook certificate"
	if wh == nil || len(wh.ClientConfig.CABundle) == 0 {
		return skip(name, "no caBundle to verify with")
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(wh.ClientConfig.CABundle) {
		return fail(name, "helm upgrade the chart (or let cert-manager's cainjector rewrite it)", "the caBundle holds no PEM certificate")
	}
	var addr, serverName string
	if svc := wh.ClientConfig.Service; svc != nil {
		serverName = svc.Name + "." + svc.Namespace + ".svc"
		eps, err := d.readyEndpoints(ctx, svc)
		if err != nil || len(eps) == 0 {
			return skip(name, "no ready endpoint to connect to")
		}
		local, stop, err := d.portForward(svc.Namespace, eps[0])
		if err != nil {
			return fail(name, "", "port-forwarding to webhook pod %s: %v", eps[0].pod, err)
		}
		defer stop()
		addr = local
	} else {
		u, err := url.Parse(ptr.Deref(wh.ClientConfig.URL, ""))
		if err != nil {
			return fail(name, "", "the registration's URL: %v", err)
		}
		addr, serverName = u.Host, u.Hostname()
		if u.Port() == "" {
			addr = net.JoinHostPort(u.Hostname(), "443")
		}
	}
	dialer := &tls.Dialer{NetDialer: &net.Dialer{Timeout: 5 * time.Second}, Config: &tls.Config{InsecureSkipVerify: true, ServerName: serverName}}
	conn, err := dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return fail(name, "check the webhook's logs", "connecting to the webhook: %v", err)
	}
	chain := conn.(*tls.Conn).ConnectionState().PeerCertificates
	conn.Close()
	leaf := chain[0]
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, DNSName: serverName})
	left := time.Until(leaf.NotAfter)
	var invalid x509.CertificateInvalidError
	switch {
	case errors.As(err, &invalid) && invalid.Reason == x509.Expired || left < 0:
		return fail(name, "renew it: with cert-manager check the Certificate's status; with certificates.mode=helm delete the Secret and helm upgrade; with mode=secret replace the Secret",
			"the webhook serves a certificate that expired at %s", leaf.NotAfter.UTC().Format(time.RFC3339))
	case err != nil:
		return fail(name, "the caBundle and the serving certificate come from different CAs: with cert-manager check cainjector; with certificates.mode=helm run helm upgrade; with mode=secret set certificates.secret.caBundle to the Secret's CA",
			"the caBundle does not verify the certificate the webhook serves for %s: %v", serverName, err)
	}
	return ok(name, "the caBundle verifies the certificate served for %s; it expires %s (in %d days)", serverName, leaf.NotAfter.UTC().Format(time.RFC3339), int(left.Hours()/24))
}

// portForward forwards a local port to the endpoint's pod, as kubectl
// port-forward does, and returns the local address and a func that stops it.
func (d *doctor) portForward(ns string, ep endpoint) (string, func(), error) {
	cfg, err := d.flags.ToRESTConfig()
	if err != nil {
		return "", nil, err
	}
	transport, upgrader, err := spdy.RoundTripperFor(cfg)
	if err != nil {
		return "", nil, err
	}
	u := d.cs.CoreV1().RESTClient().Post().Resource("pods").Namespace(ns).Name(ep.pod).SubResource("portforward").URL()
	dialer := spdy.NewDialer(upgrader, &http.Client{Transport: transport}, http.MethodPost, u)
	stop, ready := make(chan struct{}), make(chan struct{})
	fw, err := portforward.NewOnAddresses(dialer, []string{"127.0.0.1"}, []string{fmt.Sprintf("0:%d", ep.port)}, stop, ready, io.Discard, io.Discard)
	if err != nil {
		return "", nil, err
	}
	errs := make(chan error, 1)
	go func() { errs <- fw.ForwardPorts() }()
	select {
	case <-ready:
	case err := <-errs:
		return "", nil, err
	case <-time.After(10 * time.Second):
		close(stop)
		return "", nil, errors.New("timed out")
	}
	ports, err := fw.GetPorts()
	if err != nil || len(ports) == 0 {
		close(stop)
		return "", nil, fmt.Errorf("no forwarded port: %v", err)
	}
	return fmt.Sprintf("127.0.0.1:%d", ports[0].Local), func() { close(stop) }, nil
}

// checkLease checks that an aggregator holds its lease and renews it.
func (d *doctor) checkLease(ctx context.Context) Check {
	const name = "aggregator lease"
	id := d.release + "-aggregator"
	fix := fmt.Sprintf("kubectl -n %s get pods -l app.kubernetes.io/component=aggregator; kubectl -n %s logs -l app.kubernetes.io/component=aggregator", d.tallyNamespace, d.tallyNamespace)
	lease, err := d.cs.CoordinationV1().Leases(d.tallyNamespace).Get(ctx, id, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return fail(name, fix, "Lease %s/%s not found: no aggregator has ever led, so no count is written", d.tallyNamespace, id)
	}
	if err != nil {
		return fail(name, "", "reading Lease %s/%s: %v", d.tallyNamespace, id, err)
	}
	holder := ptr.Deref(lease.Spec.HolderIdentity, "")
	if holder == "" {
		return fail(name, fix, "Lease %s/%s is held by no one: no aggregator is writing counts", d.tallyNamespace, id)
	}
	if lease.Spec.RenewTime == nil || time.Since(lease.Spec.RenewTime.Time) > leaseStale {
		age := "never"
		if lease.Spec.RenewTime != nil {
			age = time.Since(lease.Spec.RenewTime.Time).Round(time.Second).String() + " ago"
		}
		return fail(name, fix, "Lease %s/%s is held by %s but was last renewed %s: its holder is gone or cannot reach the API server", d.tallyNamespace, id, holder, age)
	}
	return ok(name, "held by %s, renewed %s ago", holder, time.Since(lease.Spec.RenewTime.Time).Round(time.Second))
}

var crdGVR = schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}

// checkKind checks that a parent kind is served, has a status subresource,
// and (for a custom resource) declares every mapped field.
func (d *doctor) checkKind(ctx context.Context, p config.Parent) Check {
	name := "parent kind " + p.GroupKind().String()
	gv := schema.GroupVersion{Group: p.Group, Version: p.Version}.String()
	resources, err := d.cs.Discovery().ServerResourcesForGroupVersion(gv)
	if err != nil {
		return fail(name, "install the kind's CRD", "%s is not served: %v", gv, err)
	}
	var resource string
	status := false
	for _, r := range resources.APIResources {
		if r.Kind == p.Kind && !strings.Contains(r.Name, "/") {
			resource = r.Name
		}
	}
	for _, r := range resources.APIResources {
		if resource != "" && r.Name == resource+"/status" {
			status = true
		}
	}
	switch {
	case resource == "":
		return fail(name, "install the kind's CRD, or fix parents in the chart's values", "%s serves no kind %s", gv, p.Kind)
	case !status:
		return fail(name, "add `subresources: {status: {}}` to the CRD's version "+p.Version, "%s has no status subresource: tally writes counts only there", resource)
	}
	crd, err := d.dyn.Resource(crdGVR).Get(ctx, resource+"."+p.Group, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return ok(name, "%s served with a status subresource (built in: no CRD schema to check)", resource)
	}
	if err != nil {
		return fail(name, "", "reading CRD %s.%s: %v", resource, p.Group, err)
	}
	var missing []string
	for _, f := range p.Fields() {
		if !declared(crd, p.Version, f.Path) {
			missing = append(missing, strings.Join(f.Path, "."))
		}
	}
	if p.Tracked() {
		for _, list := range []string{"completed", "unexpected"} {
			if path := append(p.LedgerPath(), list); !declared(crd, p.Version, path) {
				missing = append(missing, strings.Join(path, "."))
			}
		}
	}
	if len(missing) > 0 {
		return fail(name, "declare them in the CRD's openAPIV3Schema for version "+p.Version+" (counts and totals as integers, the ledger's lists as arrays of strings), or unmap them",
			"the CRD does not declare %s: the API server prunes what tally writes there", strings.Join(missing, ", "))
	}
	return ok(name, "%s served with a status subresource; the CRD declares every mapped field", resource)
}

// declared reports whether the CRD's schema for version declares path (or
// keeps unknown fields on the way).
func declared(crd *unstructured.Unstructured, version string, path []string) bool {
	versions, _, _ := unstructured.NestedSlice(crd.Object, "spec", "versions")
	for _, v := range versions {
		vm, _ := v.(map[string]any)
		if vm["name"] != version {
			continue
		}
		schemaAt, _, _ := unstructured.NestedMap(vm, "schema", "openAPIV3Schema")
		for _, step := range path {
			if keep, _ := schemaAt["x-kubernetes-preserve-unknown-fields"].(bool); keep {
				return true
			}
			props, _ := schemaAt["properties"].(map[string]any)
			next, found := props[step].(map[string]any)
			if !found {
				return false
			}
			schemaAt = next
		}
		return true
	}
	return false
}

// checkTracking looks for finished pods that still carry the tracking
// finalizer trackingStuck after they finished: their deletion waits on
// tally.
func (d *doctor) checkTracking(ctx context.Context) Check {
	const name = "tracking finalizers"
	now := time.Now()
	var carrying, read, unread int
	var stuck, namespaces []string
	report := func(namespace, name string, at time.Time) {
		if now.Sub(at) > trackingStuck {
			stuck = append(stuck, fmt.Sprintf("%s/%s (%v)", namespace, name, now.Sub(at).Round(time.Second)))
			if !slices.Contains(namespaces, namespace) {
				namespaces = append(namespaces, namespace)
			}
		}
	}
	md, err := d.metadataClient()
	if err != nil {
		return fail(name, "", "%v", err)
	}
	// Pods being deleted, from their metadata.
	err = eachTracked(ctx, md, metav1.NamespaceAll, "", func(pod *metav1.PartialObjectMetadata) error {
		carrying++
		if pod.DeletionTimestamp != nil {
			grace := time.Duration(ptr.Deref(pod.DeletionGracePeriodSeconds, 0)) * time.Second
			report(pod.Namespace, pod.Name, pod.DeletionTimestamp.Add(-grace))
		}
		return nil
	})
	// Terminal pods, found by phase; when they finished is in their status,
	// read for at most maxStatusReads of them.
	for _, phase := range []corev1.PodPhase{corev1.PodSucceeded, corev1.PodFailed} {
		if err != nil {
			break
		}
		err = eachTracked(ctx, md, metav1.NamespaceAll, "status.phase="+string(phase), func(meta *metav1.PartialObjectMetadata) error {
			if meta.DeletionTimestamp != nil {
				return nil
			}
			if read >= maxStatusReads {
				unread++
				return nil
			}
			read++
			pod, err := d.cs.CoreV1().Pods(meta.Namespace).Get(ctx, meta.Name, metav1.GetOptions{})
			switch {
			case apierrors.IsNotFound(err):
				return nil // gone since
			case err != nil:
				return fmt.Errorf("reading pod %s/%s: %w", meta.Namespace, meta.Name, err)
			}
			if at, ok := finishedAt(pod); ok && slices.Contains(pod.Finalizers, keys.TrackingFinalizer) {
				report(pod.Namespace, pod.Name, at)
			}
			return nil
		})
	}
	if apierrors.IsForbidden(err) {
		return skip(name, "this user may not list the pods of every namespace")
	}
	if err != nil {
		return fail(name, "", "%v", err)
	}
	lost, err := uncounted(ctx, d.cs, metav1.NamespaceAll, "")
	if err != nil && !apierrors.IsForbidden(err) {
		return fail(name, "", "%v", err)
	}
	if len(stuck) == 0 && len(lost) > 0 {
		shown := lost[:min(len(lost), 5)]
		return fail(name, "the totals of these parents miss the pods named: their kind could not keep totals (fix its CRD: status subresource, the totals and the ledger declared), "+
			"or the aggregator could not record them within --tracking-grace (read its logs)",
			"%d report(s) of pods released without being counted in the totals: %s", len(lost), strings.Join(shown, "; "))
	}
	if len(stuck) > 0 {
		shown := stuck[:min(len(stuck), 5)]
		more := ""
		if len(stuck) > len(shown) {
			more = fmt.Sprintf(" and %d more", len(stuck)-len(shown))
		}
		fix := fmt.Sprintf("the aggregator releases a finished pod once it has recorded it: read its logs (kubectl -n %s logs -l app.kubernetes.io/component=aggregator); "+
			"for pods of no tracked parent, or after uninstalling: kubectl tally finalizers remove -n NAMESPACE (%s)", d.tallyNamespace, strings.Join(namespaces, ", "))
		if unread > 0 {
			more += fmt.Sprintf(" (%d more finished pods carry it; when they finished was not read)", unread)
		}
		return fail(name, fix, "%d finished pod(s) still carry %s more than %v after they finished (their deletion waits on it): %s%s",
			len(stuck), keys.TrackingFinalizer, trackingStuck, strings.Join(shown, ", "), more)
	}
	return ok(name, "%d pod(s) carry %s; none finished more than %v ago", carrying, keys.TrackingFinalizer, trackingStuck)
}

// finishedAt is when a pod finished: its deletion was asked for, or (a
// terminal pod) its last container ended. A terminal pod without container
// states finished when its conditions last changed.
func finishedAt(pod *corev1.Pod) (time.Time, bool) {
	if pod.DeletionTimestamp != nil {
		grace := time.Duration(ptr.Deref(pod.DeletionGracePeriodSeconds, 0)) * time.Second
		return pod.DeletionTimestamp.Add(-grace), true
	}
	if pod.Status.Phase != corev1.PodSucceeded && pod.Status.Phase != corev1.PodFailed {
		return time.Time{}, false
	}
	var at time.Time
	for _, s := range slices.Concat(pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses) {
		if t := s.State.Terminated; t != nil && t.FinishedAt.After(at) {
			at = t.FinishedAt.Time
		}
	}
	if at.IsZero() {
		for _, c := range pod.Status.Conditions {
			if c.LastTransitionTime.After(at) {
				at = c.LastTransitionTime.Time
			}
		}
	}
	return at, !at.IsZero()
}

// checkPolicies checks that the chart's ValidatingAdmissionPolicies are
// installed and bound.
func (d *doctor) checkPolicies(ctx context.Context) Check {
	const name = "admission policies"
	sel := metav1.ListOptions{LabelSelector: "app.kubernetes.io/instance=" + d.release}
	policies, err := d.cs.AdmissionregistrationV1().ValidatingAdmissionPolicies().List(ctx, sel)
	if err != nil {
		return fail(name, "", "listing ValidatingAdmissionPolicies: %v", err)
	}
	bindings, err := d.cs.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().List(ctx, sel)
	if err != nil {
		return fail(name, "", "listing ValidatingAdmissionPolicyBindings: %v", err)
	}
	if len(policies.Items) == 0 {
		return fail(name, "helm upgrade to a chart version that installs them", "no ValidatingAdmissionPolicy of release %s: tally's keys on pods/status and the aggregator's pod writes are not guarded", d.release)
	}
	var names, unbound []string
	for _, p := range policies.Items {
		names = append(names, p.Name)
		if !slices.ContainsFunc(bindings.Items, func(b admissionregistrationv1.ValidatingAdmissionPolicyBinding) bool {
			return b.Spec.PolicyName == p.Name
		}) {
			unbound = append(unbound, p.Name)
		}
	}
	if len(unbound) > 0 {
		return fail(name, "helm upgrade the chart", "ValidatingAdmissionPolicy %s has no binding: it is not enforced", strings.Join(unbound, ", "))
	}
	return ok(name, "%s bound", strings.Join(names, ", "))
}

// permission is one thing a service account must be allowed to do.
type permission struct {
	sa   string
	attr authorizationv1.ResourceAttributes
}

// checkPermissions asks the API server (SubjectAccessReview) whether each
// service account may do what its component needs.
func (d *doctor) checkPermissions(ctx context.Context, cfg *config.Config) Check {
	const name = "permissions"
	if cfg == nil {
		return skip(name, "no configuration")
	}
	agg, wh := d.release+"-aggregator", d.release+"-webhook"
	var need []permission
	for _, verb := range []string{"get", "list", "watch", "patch"} {
		need = append(need, permission{agg, authorizationv1.ResourceAttributes{Verb: verb, Resource: "pods"}})
	}
	for _, verb := range []string{"get", "update"} {
		need = append(need, permission{agg, authorizationv1.ResourceAttributes{Namespace: d.tallyNamespace, Verb: verb, Group: "coordination.k8s.io", Resource: "leases", Name: agg}})
	}
	mapper, err := d.flags.ToRESTMapper()
	if err != nil {
		return fail(name, "", "reading the API's resources: %v", err)
	}
	for _, p := range cfg.Parents {
		resource := p.Resource
		if resource == "" {
			// Resolved through discovery, as the aggregator does; a kind
			// that is not served is the parent kind check's failure.
			mapping, err := mapper.RESTMapping(p.GroupKind(), p.Version)
			if err != nil {
				continue
			}
			resource = mapping.Resource.Resource
		}
		for _, verb := range []string{"get", "list", "watch"} {
			need = append(need, permission{agg, authorizationv1.ResourceAttributes{Verb: verb, Group: p.Group, Resource: resource}})
			if cfg.VerifyOwner {
				need = append(need, permission{wh, authorizationv1.ResourceAttributes{Verb: verb, Group: p.Group, Resource: resource}})
			}
		}
		need = append(need, permission{agg, authorizationv1.ResourceAttributes{Verb: "patch", Group: p.Group, Resource: resource, Subresource: "status"}})
	}
	var denied []string
	for _, n := range need {
		attr := n.attr
		sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{
			User:               "system:serviceaccount:" + d.tallyNamespace + ":" + n.sa,
			Groups:             []string{"system:serviceaccounts", "system:serviceaccounts:" + d.tallyNamespace, "system:authenticated"},
			ResourceAttributes: &attr,
		}}
		res, err := d.cs.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
		if err != nil {
			return fail(name, "run doctor as a user who may create SubjectAccessReviews", "asking the API server: %v", err)
		}
		if !res.Status.Allowed {
			what := attr.Resource
			if attr.Subresource != "" {
				what += "/" + attr.Subresource
			}
			if attr.Group != "" {
				what += "." + attr.Group
			}
			denied = append(denied, fmt.Sprintf("%s may not %s %s", n.sa, attr.Verb, what))
		}
	}
	if len(denied) > 0 {
		return fail(name, "helm upgrade the chart: its RBAC is generated from parents (each needs its resource)", "%s", strings.Join(denied, "; "))
	}
	return ok(name, "%s and %s may do what they need (%d checks)", agg, wh, len(need))
}
