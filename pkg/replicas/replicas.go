// Package replicas holds what a manager runs on every replica, whether or
// not it leads.
package replicas

import "context"

// Every is a runnable that runs whether or not the replica leads: a
// controller-runtime manager starts a runnable that does not say so only on
// the leader.
type Every func(context.Context) error

// Start runs f.
func (f Every) Start(ctx context.Context) error { return f(ctx) }

// NeedLeaderElection reports that every replica runs f.
func (Every) NeedLeaderElection() bool { return false }
