package framework

import (
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// APIProxy serves the API server in plain HTTP on a loopback port, through
// cfg's transport: its credentials, and the faults of whatever cfg wraps
// (a WatchBreaker). A child process given its kubeconfig meets the same
// faults as a client built in the test from cfg would. Writes can be
// answered 429, as API Priority and Fairness does, and the API server's
// clock, as its answers' Date headers show it, stepped.
type APIProxy struct {
	l   net.Listener
	srv *http.Server

	mu        sync.Mutex
	throttled bool
	// step moves the Date of every answer.
	step time.Duration
}

// NewAPIProxy starts a proxy to cfg's API server.
func NewAPIProxy(cfg *rest.Config) (*APIProxy, error) {
	target, err := url.Parse(cfg.Host)
	if err != nil {
		return nil, fmt.Errorf("the API server's address %q: %w", cfg.Host, err)
	}
	rt, err := rest.TransportFor(cfg)
	if err != nil {
		return nil, err
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &APIProxy{l: l}
	forward := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(target)
			r.Out.Host = target.Host
			// The proxy's transport asks for gzip itself and hands the
			// faults (and the client) the body decompressed: a relist
			// trickled byte by byte reaches the client as it comes, not
			// one deflate block in minutes.
			r.Out.Header.Del("Accept-Encoding")
		},
		Transport: rt,
		// Watches stream: each event is passed on as it comes.
		FlushInterval: -1,
		// A cut, a broken watch or a killed client is the test's doing.
		ErrorLog: log.New(io.Discard, "", 0),
		ModifyResponse: func(resp *http.Response) error {
			p.mu.Lock()
			step := p.step
			p.mu.Unlock()
			if date, err := http.ParseTime(resp.Header.Get("Date")); err == nil && step != 0 {
				resp.Header.Set("Date", date.Add(step).UTC().Format(http.TimeFormat))
			}
			return nil
		},
	}
	p.srv = &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if p.throttles(r) {
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			fmt.Fprint(w, `{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"too many requests (throttled by the test)","reason":"TooManyRequests","details":{"retryAfterSeconds":1},"code":429}`)
			return
		}
		forward.ServeHTTP(w, r)
	}), ErrorLog: log.New(io.Discard, "", 0)}
	go func() { _ = p.srv.Serve(l) }()
	return p, nil
}

// Addr returns the proxy's "127.0.0.1:port".
func (p *APIProxy) Addr() string { return p.l.Addr().String() }

// Close stops the proxy and closes its connections.
func (p *APIProxy) Close() { _ = p.srv.Close() }

// ThrottleWrites starts or ends answering 429 to every write but the
// Lease's (status applies, finalizer releases, Events): a throttled holder
// keeps its lease.
func (p *APIProxy) ThrottleWrites(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.throttled = on
}

// StepClock steps the API server's clock as the proxy's clients see it:
// the Date of every answer is moved by step from now on (0: the API
// server's own again). The times the API server stamps on objects are not:
// to a client, the clock stepped after they were stamped.
func (p *APIProxy) StepClock(step time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.step = step
}

func (p *APIProxy) throttles(r *http.Request) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.throttled && r.Method != http.MethodGet && !strings.Contains(r.URL.Path, "/leases/")
}

// ProxiedKubeconfig starts an APIProxy to cfg's API server, stopped when
// the test ends, and returns the path of a kubeconfig that reaches it: a
// child process given it meets the faults of whatever cfg wraps.
func ProxiedKubeconfig(t testing.TB, cfg *rest.Config) string {
	t.Helper()
	proxy, err := NewAPIProxy(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(proxy.Close)
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := WriteKubeconfig(proxy.Addr(), path); err != nil {
		t.Fatal(err)
	}
	return path
}

// WriteKubeconfig writes a kubeconfig, with no credentials, that reaches
// the API server at addr ("127.0.0.1:port", such as an APIProxy's or a
// Proxy in front of it) in plain HTTP.
func WriteKubeconfig(addr, path string) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["proxy"] = &clientcmdapi.Cluster{Server: "http://" + addr}
	cfg.AuthInfos["proxy"] = &clientcmdapi.AuthInfo{}
	cfg.Contexts["proxy"] = &clientcmdapi.Context{Cluster: "proxy", AuthInfo: "proxy"}
	cfg.CurrentContext = "proxy"
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return err
	}
	return os.WriteFile(path, data, 0o600)
}
