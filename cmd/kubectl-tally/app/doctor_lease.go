package app

import (
	"context"
	"fmt"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

// leaseStale is how old the aggregator's lease renewal may be: twice the
// lease duration.
const leaseStale = 30 * time.Second

// leaseCheck checks that an aggregator holds its lease and renews it.
type leaseCheck struct{}

func (leaseCheck) name() string { return "aggregator lease" }

func (c leaseCheck) run(ctx context.Context, d *doctor) Check {
	name := c.name()
	id := d.release + "-aggregator"
	fix := fmt.Sprintf("kubectl -n %s get pods -l app.kubernetes.io/component=aggregator; kubectl -n %s logs -l app.kubernetes.io/component=aggregator", d.tallyNamespace, d.tallyNamespace)
	lease, err := d.cs.CoordinationV1().Leases(d.tallyNamespace).Get(ctx, id, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return fail(name, fix, "Lease %s/%s not found: no aggregator has ever led, so no count is written", d.tallyNamespace, id)
	}
	if err != nil {
		return fail(name, "", "reading Lease %s/%s: %v", d.tallyNamespace, id, err)
	}
	holder := ptr.Deref(lease.Spec.HolderIdentity, "")
	if holder == "" {
		return fail(name, fix, "Lease %s/%s is held by no one: no aggregator is writing counts", d.tallyNamespace, id)
	}
	if lease.Spec.RenewTime == nil || time.Since(lease.Spec.RenewTime.Time) > leaseStale {
		age := "never"
		if lease.Spec.RenewTime != nil {
			age = time.Since(lease.Spec.RenewTime.Time).Round(time.Second).String() + " ago"
		}
		return fail(name, fix, "Lease %s/%s is held by %s but was last renewed %s: its holder is gone or cannot reach the API server", d.tallyNamespace, id, holder, age)
	}
	return ok(name, "held by %s, renewed %s ago", holder, time.Since(lease.Spec.RenewTime.Time).Round(time.Second))
}
