package apiclock

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/client-go/rest"
)

// TestNowIsTheAPIServers: an API server whose clock is years from the
// local one gives its time, from its answers for the core group, moving on
// with the local monotonic clock; before any such answer, the local time.
func TestNowIsTheAPIServers(t *testing.T) {
	server := time.Date(2001, 1, 1, 0, 0, 0, 0, time.UTC)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Date", server.Format(http.TimeFormat))
		_, _ = w.Write([]byte("{}"))
	}))
	defer srv.Close()
	var c Clock
	assert.WithinDuration(t, time.Now(), c.Now(), time.Second, "before any answer")
	cfg := &rest.Config{Host: srv.URL}
	c.Wrap(cfg)
	client, err := rest.HTTPClientFor(cfg)
	require.NoError(t, err)
	resp, err := client.Get(srv.URL + "/apis/metrics.example.io/v1/things")
	require.NoError(t, err)
	resp.Body.Close()
	assert.WithinDuration(t, time.Now(), c.Now(), time.Second, "an answer another API server may have given")
	resp, err = client.Get(srv.URL + "/api/v1/namespaces/ns/pods/p")
	require.NoError(t, err)
	resp.Body.Close()
	assert.WithinDuration(t, server, c.Now(), time.Second)
	time.Sleep(200 * time.Millisecond)
	assert.WithinDuration(t, server.Add(200*time.Millisecond), c.Now(), 100*time.Millisecond, "moves on with the monotonic clock")
}

func TestObserveIgnoresWhatIsNoDate(t *testing.T) {
	var c Clock
	c.observe("", time.Now())
	c.observe("yesterday", time.Now())
	assert.True(t, c.at.IsZero())
}
