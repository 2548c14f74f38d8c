package app

import (
	"crypto/tls"
	"crypto/x509"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"sigs.k8s.io/controller-runtime/pkg/metrics"
)

// servingCert is the certificate the running server serves, for
// tally_webhook_certificate_expiry_timestamp_seconds.
var servingCert = struct {
	sync.Mutex
	get func(*tls.ClientHelloInfo) (*tls.Certificate, error)
}{}

func init() {
	metrics.Registry.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "tally_webhook_certificate_expiry_timestamp_seconds",
		Help: "When the serving certificate the webhook serves now expires (its NotAfter, Unix seconds); 0 before it serves. The certificate is read again when its files change.",
	}, certificateExpiry))
}

// serveCertificate makes get the source of the expiry metric.
func serveCertificate(get func(*tls.ClientHelloInfo) (*tls.Certificate, error)) {
	servingCert.Lock()
	defer servingCert.Unlock()
	servingCert.get = get
}

// certificateExpiry returns the NotAfter of the certificate served now, in
// Unix seconds; 0 when none is.
func certificateExpiry() float64 {
	servingCert.Lock()
	get := servingCert.get
	servingCert.Unlock()
	if get == nil {
		return 0
	}
	cert, err := get(nil)
	if err != nil || cert == nil || len(cert.Certificate) == 0 {
		return 0
	}
	leaf := cert.Leaf
	if leaf == nil {
		if leaf, err = x509.ParseCertificate(cert.Certificate[0]); err != nil {
			return 0
		}
	}
	return float64(leaf.NotAfter.Unix())
}
