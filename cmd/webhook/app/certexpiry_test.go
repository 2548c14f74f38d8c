package app

import (
	"crypto/tls"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"tally.dev/tally/certs/devcert"
)

func TestCertificateExpiry(t *testing.T) {
	t.Cleanup(func() { serveCertificate(nil) })
	assert.Zero(t, certificateExpiry(), "nothing served yet")

	ca, err := devcert.NewCA("expiry test CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"127.0.0.1"}, 3*time.Hour)
	require.NoError(t, err)
	dir := t.TempDir()
	require.NoError(t, pair.WriteDir(dir))
	cert, err := tls.LoadX509KeyPair(dir+"/tls.crt", dir+"/tls.key")
	require.NoError(t, err)
	serveCertificate(func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return &cert, nil })
	assert.InDelta(t, float64(time.Now().Add(3*time.Hour).Unix()), certificateExpiry(), 120)

	serveCertificate(func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return nil, errors.New("no certificate") })
	assert.Zero(t, certificateExpiry())
}
