package process

import (
	"context"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
)

// Interruptible returns a context canceled on the first SIGINT or SIGTERM,
// and a func that tells which of them came, if one did. A second signal
// ends the process at once, as it would without the handling: a program
// that stops what it started (the demo, the bench) cannot be kept from
// exiting by a stop that hangs.
func Interruptible() (context.Context, func() os.Signal) {
	ctx, cancel := context.WithCancel(context.Background())
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	var got atomic.Value
	go func() {
		sig := <-signals
		got.Store(sig)
		signal.Stop(signals)
		cancel()
	}()
	return ctx, func() os.Signal {
		sig, _ := got.Load().(os.Signal)
		return sig
	}
}
