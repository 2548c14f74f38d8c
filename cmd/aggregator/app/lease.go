package app

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/util/uuid"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
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
