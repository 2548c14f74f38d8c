package app

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/uuid"
	"k8s.io/client-go/discovery"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"sigs.k8s.io/controller-runtime/pkg/manager"
)

// Leader election timing: a standby takes over LeaseDuration after the
// leader's last renewal; the leader gives up when it cannot renew within
// RenewDeadline.
const (
	LeaseDuration = 15 * time.Second
	RenewDeadline = 10 * time.Second
	RetryPeriod   = 2 * time.Second
)

// inClusterNamespace is where a pod finds its own namespace.
const inClusterNamespace = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// fencedLock is the Lease lock of leader election, which also tells whether
// this replica may still write. Lease-based election does not fence writes:
// a leader that was paused (a stopped process, a long GC, a frozen VM) can
// resume and write before it notices that a standby took over. So the lock
// records when each of this replica's renewals was sent: a standby takes
// over only LeaseDuration after it observed the lease change, which is
// after the renewal was sent, so until sent+LeaseDuration no other replica
// can lead, and from then on this one must not write.
type fencedLock struct {
	resourcelock.Interface
	mu         sync.Mutex
	validUntil time.Time
}

// newIdentity returns this process's identity in leader election: one for
// the life of the process, so that a manager started again in it after the
// API server was away renews its own lease at once instead of waiting a
// whole lease for it to expire.
func newIdentity() (string, error) {
	host, err := os.Hostname()
	if err != nil {
		return "", err
	}
	return host + "_" + string(uuid.NewUUID()), nil
}

// newFencedLock returns the Lease lock named id in namespace, held as
// identity.
func newFencedLock(cfg *rest.Config, namespace, id, identity string) (*fencedLock, error) {
	cfg = rest.AddUserAgent(rest.CopyConfig(cfg), "leader-election")
	// One hung request must not cost the lease.
	cfg.Timeout = RenewDeadline / 2
	core, err := corev1client.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	coord, err := coordinationv1client.NewForConfig(cfg)
	if err != nil {
		return nil, err
	}
	lock, err := resourcelock.New(resourcelock.LeasesResourceLock, namespace, id, core, coord,
		resourcelock.ResourceLockConfig{Identity: identity})
	if err != nil {
		return nil, fmt.Errorf("creating the leader election lock: %w", err)
	}
	return &fencedLock{Interface: lock}, nil
}

// Create takes the lease, and records when.
func (l *fencedLock) Create(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
	sent := time.Now()
	err := l.Interface.Create(ctx, ler)
	l.renewed(sent, ler, err)
	return err
}

// Update renews (or takes) the lease, and records when.
func (l *fencedLock) Update(ctx context.Context, ler resourcelock.LeaderElectionRecord) error {
	sent := time.Now()
	err := l.Interface.Update(ctx, ler)
	l.renewed(sent, ler, err)
	return err
}

func (l *fencedLock) renewed(sent time.Time, ler resourcelock.LeaderElectionRecord, err error) {
	if err != nil || ler.HolderIdentity != l.Identity() {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	l.validUntil = sent.Add(time.Duration(ler.LeaseDurationSeconds) * time.Second)
}

// Holds reports whether no other replica can have taken the lease over: the
// last renewal this replica sent is less than the lease duration old. The
// time is monotonic, so it runs on while the process is stopped.
func (l *fencedLock) Holds() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return time.Now().Before(l.validUntil)
}

// staleLeaderAfter is how long the leader keeps the lease while its pod view
// is stale and the API server answers.
const staleLeaderAfter = 10 * time.Second

// errStaleLeader stops a leader whose pod view stays stale while the API
// server answers.
var errStaleLeader = errors.New("giving up the lease: the pod view stayed stale while the API server answers")

// staleLeader runs on the leader: when its pod view has stayed stale for
// after (staleLeaderAfter) while the API server answered, it stops the
// manager, which releases the lease, so that a replica with a fresh view
// takes over (this one starts again with new caches, and competes after 2
// RetryPeriods). Only the time the API server answered, and did not throttle
// the pod list or watch, counts: a view that is stale because the API server
// is away, or throttles pod lists (429), is not this replica's fault (every
// replica's is), and after an outage the watch needs a moment to deliver
// again. Nothing is written from the stale view meanwhile (MayWrite).
func staleLeader(restCfg *rest.Config, watch *watchMonitor, after time.Duration) manager.Runnable {
	return manager.RunnableFunc(func(ctx context.Context) error {
		cfg := rest.CopyConfig(restCfg)
		cfg.Timeout = 2 * time.Second
		disco, err := discovery.NewDiscoveryClientForConfig(cfg)
		if err != nil {
			return err
		}
		ticker := time.NewTicker(time.Second)
		defer ticker.Stop()
		// answering is since when the API server has answered while the
		// view was stale; zero when it has not.
		var answering time.Time
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-ticker.C:
			}
			if watch.fresh() || watch.isThrottled() {
				// Throttling is back-pressure, which every replica would
				// meet alike: giving up the lease would only make each new
				// leader relist, and the lease change hands in turn.
				answering = time.Time{}
				continue
			}
			if _, err := disco.ServerVersion(); err != nil {
				answering = time.Time{}
				continue
			}
			if answering.IsZero() {
				answering = time.Now()
			}
			if waited := time.Since(answering); waited >= after {
				return fmt.Errorf("%w (stale for %s, %s of it with the API server answering)", errStaleLeader,
					watch.stale().Round(time.Second), waited.Round(time.Second))
			}
		}
	})
}
