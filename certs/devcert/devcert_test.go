package devcert

import (
	"crypto/tls"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestIssueVerifiesAgainstCA(t *testing.T) {
	ca, err := NewCA("tally dev CA", time.Hour)
	require.NoError(t, err)
	pair, err := ca.Issue([]string{"tally-webhook.tally-system.svc", "127.0.0.1"}, time.Hour)
	require.NoError(t, err)

	dir := t.TempDir()
	require.NoError(t, pair.WriteDir(dir))
	kp, err := tls.LoadX509KeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
	require.NoError(t, err)
	leaf, err := x509.ParseCertificate(kp.Certificate[0])
	require.NoError(t, err)

	roots := x509.NewCertPool()
	require.True(t, roots.AppendCertsFromPEM(ca.CertPEM))
	for _, host := range []string{"tally-webhook.tally-system.svc", "127.0.0.1"} {
		_, err = leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: host})
		assert.NoError(t, err, host)
	}
	_, err = leaf.Verify(x509.VerifyOptions{Roots: roots, DNSName: "other.svc"})
	assert.Error(t, err)

	info, err := os.Stat(filepath.Join(dir, "tls.key"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), info.Mode().Perm())

	_, err = ca.Issue(nil, time.Hour)
	assert.ErrorContains(t, err, "at least one host")
}
