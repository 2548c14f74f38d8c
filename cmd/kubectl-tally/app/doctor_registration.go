package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"tally.dev/tally/pkg/mutate"
)

// registrationCheck checks the MutatingWebhookConfiguration: present, with a CA
// bundle, and matching the configured kinds. The checks of the webhook's
// endpoints and certificate follow what it finds.
type registrationCheck struct{}

func (registrationCheck) name() string { return "webhook registration" }

func (c registrationCheck) run(ctx context.Context, d *doctor) Check {
	name := c.name()
	mwc, err := d.cs.AdmissionregistrationV1().MutatingWebhookConfigurations().Get(ctx, d.release, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return fail(name, "helm upgrade --install the chart: without the registration no pod is stamped",
			"MutatingWebhookConfiguration %s not found", d.release)
	}
	if err != nil {
		return fail(name, "", "reading MutatingWebhookConfiguration %s: %v", d.release, err)
	}
	if len(mwc.Webhooks) == 0 {
		return fail(name, "helm upgrade the chart", "MutatingWebhookConfiguration %s has no webhook", d.release)
	}
	wh := &mwc.Webhooks[0]
	d.webhook = wh
	if len(wh.ClientConfig.CABundle) == 0 {
		fix := "with certificates.mode=cert-manager, check that cert-manager's cainjector runs; otherwise helm upgrade the chart"
		return fail(name, fix, "webhook %s has no caBundle: the API server cannot call it", wh.Name)
	}
	if pauseIndex(*wh) >= 0 {
		fix := fmt.Sprintf("an uninstall was killed part-way: run helm uninstall again to finish it; to keep tally instead, delete that match condition (kubectl edit mutatingwebhookconfiguration %s) and scale the aggregator back up", d.release)
		return fail(name, fix, "webhook %s is paused (match condition %s): no pod is stamped", wh.Name, PauseCondition)
	}
	if d.cfg != nil {
		for _, want := range mutate.MatchConditions(d.cfg) {
			i := slices.IndexFunc(wh.MatchConditions, func(c admissionregistrationv1.MatchCondition) bool { return c.Name == want.Name })
			if i < 0 || wh.MatchConditions[i].Expression != want.Expression {
				return fail(name, "helm upgrade the chart so that the registration and the ConfigMap come from the same values",
					"its match condition %s does not follow the configured parent kinds and verifyOwner", want.Name)
			}
		}
	}
	return ok(name, "MutatingWebhookConfiguration %s: failurePolicy %s, %s", d.release, ptr.Deref(wh.FailurePolicy, ""), target(wh))
}

func target(wh *admissionregistrationv1.MutatingWebhook) string {
	if s := wh.ClientConfig.Service; s != nil {
		return fmt.Sprintf("Service %s/%s port %d", s.Namespace, s.Name, ptr.Deref(s.Port, 443))
	}
	return "URL " + ptr.Deref(wh.ClientConfig.URL, "")
}

// certificateCheck connects to the webhook as the API server would and
// verifies the certificate it presents with the registration's caBundle.
type certificateCheck struct{}

func (certificateCheck) name() string { return "webhook certificate" }

func (c certificateCheck) run(ctx context.Context, d *doctor) Check {
	name, wh := c.name(), d.webhook
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
