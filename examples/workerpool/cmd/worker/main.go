// Command worker is the WorkerPool example's worker: it works until it is
// stopped, then drains for --drain and exits 0 on SIGTERM. To exercise
// failures, WORKER_CRASH_PERCENT (0-100) is the chance that it crashes
// (exit 1) after 2 to 8 seconds instead.
package main

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"
)

func main() {
	drain := 500 * time.Millisecond
	if v := os.Getenv("WORKER_DRAIN"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			fmt.Fprintf(os.Stderr, "worker: WORKER_DRAIN=%q: %v\n", v, err)
			os.Exit(2)
		}
		drain = d
	}
	var crash <-chan time.Time
	if v := os.Getenv("WORKER_CRASH_PERCENT"); v != "" {
		p, err := strconv.Atoi(v)
		if err != nil || p < 0 || p > 100 {
			fmt.Fprintf(os.Stderr, "worker: WORKER_CRASH_PERCENT=%q is not a percentage\n", v)
			os.Exit(2)
		}
		if rand.IntN(100) < p {
			crash = time.After(2*time.Second + rand.N(6*time.Second))
		}
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	fmt.Printf("worker: working (completion intent %q)\n", os.Getenv("COMPLETION_INTENT"))
	select {
	case sig := <-signals:
		fmt.Printf("worker: %v: draining for %v\n", sig, drain)
		time.Sleep(drain)
		fmt.Println("worker: done")
	case <-crash:
		fmt.Fprintln(os.Stderr, "worker: crashing")
		os.Exit(1)
	}
}
