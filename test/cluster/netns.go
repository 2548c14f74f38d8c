package cluster

import (
	"net"
	"os"
	"path/filepath"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// dialFrom reports whether a TCP connection to addr succeeds from inside the
// named network namespace (a further node's, /run/netns/<node>): there the
// node's own kube-proxy translates a Service address. The goroutine that
// enters the namespace keeps its OS thread locked until it ends, so the
// runtime discards that thread instead of reusing it elsewhere.
func dialFrom(netns, addr string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		f, err := os.Open(filepath.Join("/run/netns", netns))
		if err != nil {
			errc <- err
			return
		}
		defer f.Close()
		if err := unix.Setns(int(f.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- err
			return
		}
		conn, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err == nil {
			conn.Close()
		}
		errc <- err
	}()
	return <-errc
}
