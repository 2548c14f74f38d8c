package framework

import (
	"io"
	"net"
	"sync"
)

// Proxy forwards TCP connections on a loopback port to its backends, in
// turn. It can be cut off (every connection closed, new ones refused), and
// its backends changed while it runs, as a Service's endpoints change.
type Proxy struct {
	l        net.Listener
	mu       sync.Mutex
	backends []string
	next     int
	cut      bool
	conns    []net.Conn
}

// NewProxy starts a proxy to backends ("host:port").
func NewProxy(backends ...string) (*Proxy, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{l: l, backends: backends}
	go p.serve()
	return p, nil
}

// Addr returns the proxy's "127.0.0.1:port".
func (p *Proxy) Addr() string { return p.l.Addr().String() }

// Close stops the proxy and closes its connections.
func (p *Proxy) Close() {
	p.l.Close()
	p.CutOff()
}

// SetBackends replaces the backends new connections go to; connections
// already open stay where they are.
func (p *Proxy) SetBackends(backends ...string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.backends = backends
}

// CutOff closes every connection and refuses new ones until Restore.
func (p *Proxy) CutOff() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = true
	for _, c := range p.conns {
		c.Close()
	}
	p.conns = nil
}

// Restore accepts connections again.
func (p *Proxy) Restore() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = false
}

func (p *Proxy) serve() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut || len(p.backends) == 0 {
			p.mu.Unlock()
			c.Close()
			continue
		}
		backend := p.backends[p.next%len(p.backends)]
		p.next++
		p.mu.Unlock()
		up, err := net.Dial("tcp", backend)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, c, up)
		p.mu.Unlock()
		go func() { _, _ = io.Copy(up, c); up.Close() }()
		go func() { _, _ = io.Copy(c, up); c.Close() }()
	}
}
