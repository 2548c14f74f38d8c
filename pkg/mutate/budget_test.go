package mutate

import (
	"bytes"
	"context"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBudgetUnderRandomLoad runs as many requests at once as the server
// admits connections, with random sizes, random holds (a stalled body) and
// random cancellations: every reservation comes back, no wait outlasts its
// bound, and small bodies never wait, whatever the large ones do.
func TestBudgetUnderRandomLoad(t *testing.T) {
	const wait = 20 * time.Millisecond
	b := newBudget(wait)
	var (
		smallWaited, smallRefused atomic.Int32
		granted, refused          atomic.Int32
		longest                   atomic.Int64
	)
	var wg sync.WaitGroup
	for g := range MaxConnections {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for range 40 {
				var size int64
				switch rng.IntN(4) {
				case 0, 1:
					size = 1 + rng.Int64N(SmallBody)
				case 2:
					size = SmallBody + 1 + rng.Int64N(MediumBody-SmallBody)
				default:
					size = MediumBody + 1 + rng.Int64N(MaxBodyBytes-MediumBody)
				}
				if rng.IntN(20) == 0 {
					size = -1 // chunked: reserves the largest body
				}
				ctx, cancel := context.WithCancel(context.Background())
				if rng.IntN(10) == 0 {
					time.AfterFunc(time.Duration(rng.IntN(10))*time.Millisecond, cancel)
				}
				res, waited, err := b.reserve(ctx, size, time.Now)
				cancel()
				longest.Store(max(longest.Load(), int64(waited)))
				if size > 0 && size <= SmallBody {
					if waited != 0 {
						smallWaited.Add(1)
					}
					if err != nil {
						smallRefused.Add(1)
					}
				}
				if err != nil {
					refused.Add(1)
					continue
				}
				granted.Add(1)
				if rng.IntN(3) == 0 { // a body that stalls
					time.Sleep(time.Duration(rng.IntN(5)) * time.Millisecond)
				}
				res.release()
			}
		})
	}
	wg.Wait()

	t.Logf("%d granted, %d refused, longest wait %s", granted.Load(), refused.Load(), time.Duration(longest.Load()))
	assert.Zero(t, smallWaited.Load(), "small bodies that waited")
	assert.Zero(t, smallRefused.Load(), "small bodies refused")
	assert.Positive(t, refused.Load(), "the load exceeds the large share: some requests must be refused")
	// The bound plus scheduling on a loaded, race-instrumented machine.
	assert.Less(t, time.Duration(longest.Load()), wait+2*time.Second, "longest wait")
	for _, s := range b.classes {
		require.True(t, s.sem.TryAcquire(s.size), "the %s share is whole again", s.name)
		s.sem.Release(s.size)
	}
}

// TestBudgetNeverWaitsHoldingMemory: a request waiting for memory holds
// none, so holders that stall cannot keep each other waiting, and once they
// go the memory is whole again.
func TestBudgetNeverWaitsHoldingMemory(t *testing.T) {
	b := newBudget(50 * time.Millisecond)
	var held []reservation
	for {
		res, _, err := b.reserve(context.Background(), MaxBodyBytes, time.Now)
		if err != nil {
			require.ErrorContains(t, err, "large bodies' share")
			break
		}
		held = append(held, res)
	}
	assert.Len(t, held, largeShare/MaxBodyBytes)
	small, waited, err := b.reserve(context.Background(), 4<<10, time.Now)
	require.NoError(t, err, "a small body while the large share is full")
	assert.Zero(t, waited)
	small.release()
	medium, _, err := b.reserve(context.Background(), 300<<10, time.Now)
	require.NoError(t, err, "a medium body while the large share is full")
	medium.release()
	for _, r := range held {
		r.release()
	}
	res, waited, err := b.reserve(context.Background(), -1, time.Now)
	require.NoError(t, err, "a body of unknown length once the holders are gone")
	assert.Zero(t, waited)
	assert.Equal(t, int64(MaxBodyBytes), res.limit)
	assert.Equal(t, int64(MaxBodyBytes+bytes.MinRead+DecodeAllowance), res.bytes, "the buffer it is read into and what decoding keeps")
	res.release()
}

func TestBudgetStuck(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	b := newBudget(time.Millisecond)
	var held []reservation
	for {
		res, _, err := b.reserve(context.Background(), MediumBody, clock)
		if err != nil {
			break
		}
		held = append(held, res)
	}
	require.NoError(t, b.stuck(now.Add(time.Minute), time.Minute), "within the bound")
	require.ErrorContains(t, b.stuck(now.Add(2*time.Minute), time.Minute), "the medium bodies' share has refused every request and freed nothing for 2m0s")
	held[0].release()
	require.NoError(t, b.stuck(now.Add(2*time.Minute), time.Minute), "memory freed: the share is busy, not stuck")

	var err error
	held[0], _, err = b.reserve(context.Background(), MediumBody, clock)
	require.NoError(t, err)
	_, _, err = b.reserve(canceled(), MediumBody, clock)
	require.ErrorContains(t, err, "request ended while waiting")
	require.NoError(t, b.stuck(now.Add(5*time.Minute), time.Minute), "a client that went away is not a refusal")
	for _, r := range held[1:] {
		r.release()
	}
}

func canceled() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// TestBuffersStayWithinTheirReservation: whatever the order of body sizes,
// the buffer each body is read into holds no more than the body reserved,
// reused buffers included (a medium body's buffer is never handed to a
// small body).
func TestBuffersStayWithinTheirReservation(t *testing.T) {
	b := newBudget(time.Second)
	rng := rand.New(rand.NewPCG(40, 1))
	for i := range 400 {
		var size int64
		switch rng.IntN(3) {
		case 0:
			size = 1 + rng.Int64N(SmallBody)
		case 1:
			size = SmallBody + 1 + rng.Int64N(MediumBody-SmallBody)
		default:
			size = MediumBody + 1 + rng.Int64N(MaxBodyBytes-MediumBody)
		}
		announced := size
		if rng.IntN(10) == 0 {
			announced = -1 // of unknown length
		}
		res, _, err := b.reserve(context.Background(), announced, time.Now)
		require.NoError(t, err)
		buf := res.buffer()
		r := httptest.NewRequest(http.MethodPost, Path, bytes.NewReader(make([]byte, size)))
		r.ContentLength = announced
		require.NoError(t, readBody(r, buf, res.limit))
		require.Equal(t, int(size), buf.Len())
		require.LessOrEqual(t, int64(buf.Cap()), res.bytes, "request %d: a body of %d bytes (announced %d) held a buffer of %d bytes, reserved %d", i, size, announced, buf.Cap(), res.bytes)
		putBuffer(buf)
		res.release()
	}
}
