package app

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/tools/portforward"
	"k8s.io/client-go/transport/spdy"
	"k8s.io/utils/ptr"
)

// endpointsCheck checks that the webhook's Service has ready endpoints.
type endpointsCheck struct{}

func (endpointsCheck) name() string { return "webhook endpoints" }

func (c endpointsCheck) run(ctx context.Context, d *doctor) Check {
	name, wh := c.name(), d.webhook
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
