package framework

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"tally.dev/tally/internal/helm"
	"tally.dev/tally/pkg/config"
	"tally.dev/tally/pkg/mutate"
)

// ServingCertificate dials a TLS server trusting caPEM and returns the
// certificate it serves.
func ServingCertificate(host string, port int, caPEM []byte) (*x509.Certificate, error) {
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		return nil, errors.New("no CA certificate in caPEM")
	}
	d := &net.Dialer{Timeout: time.Second}
	conn, err := tls.DialWithDialer(d, "tcp", net.JoinHostPort(host, strconv.Itoa(port)), &tls.Config{RootCAs: roots, ServerName: host, MinVersion: tls.VersionTLS12})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0], nil
}

// WaitForTLS waits until a TLS server trusting caPEM answers on host:port.
func WaitForTLS(ctx context.Context, host string, port int, caPEM []byte) error {
	for {
		_, err := ServingCertificate(host, port, caPEM)
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("webhook at %s:%d never served TLS: %w", host, port, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// NamespaceLabel labels a namespace with its own name, so that a webhook
// registered by RegisterWebhook selects it and no other.
const NamespaceLabel = "tally.dev/test-namespace"

// WebhookNamespace creates a namespace with a generated name, labelled for
// RegisterWebhook, and returns its name.
func (e *Env) WebhookNamespace(t testing.TB, prefix string) string {
	t.Helper()
	ctx := context.Background()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{GenerateName: prefix + "-"}}
	if err := e.Client.Create(ctx, ns); err != nil {
		t.Fatal(err)
	}
	ns.Labels[NamespaceLabel] = ns.Name
	if err := e.Client.Update(ctx, ns); err != nil {
		t.Fatal(err)
	}
	return ns.Name
}

// RegisterWebhook registers tally's pod webhook for cfg, as the chart
// does, calling clientConfig for the pods of namespace ns only (created by
// WebhookNamespace), with failure policy policy; the registration is removed
// when the test ends. The API server picks it up asynchronously.
func (e *Env) RegisterWebhook(t testing.TB, cfg *config.Config, clientConfig admissionregistrationv1.WebhookClientConfig, ns string, policy admissionregistrationv1.FailurePolicyType) {
	t.Helper()
	wh := mutate.Webhook(cfg, clientConfig, helm.AggregatorUser)
	wh.FailurePolicy = &policy
	wh.NamespaceSelector = &metav1.LabelSelector{MatchLabels: map[string]string{NamespaceLabel: ns}}
	mwc := &admissionregistrationv1.MutatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: "tally-" + ns},
		Webhooks:   []admissionregistrationv1.MutatingWebhook{wh},
	}
	if err := e.Client.Create(context.Background(), mwc); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Client.Delete(context.Background(), mwc) })
}
