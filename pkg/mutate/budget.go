package mutate

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"
)

// The memory that request bodies may hold at once is split by body size, so
// that the API server's ordinary reviews are never stuck behind other
// clients' large or slow bodies:
//
//   - A body reserves, once, before its first byte is read, from the share
//     of its size class, the memory of the buffer it will be read into and
//     DecodeAllowance for what decoding it keeps: its whole announced
//     length (Content-Length) for a medium or large body, read into a
//     buffer of that size and then let go; the class's largest body for a
//     small one, read into a buffer of exactly that size that small bodies
//     reuse. So the buffers requests hold, and what their decoding keeps,
//     never exceed what they reserved, whatever the order of requests and
//     whatever a body holds. A body of unknown length reserves the largest
//     body allowed. No request ever waits while
//     it holds part of a reservation, so waiters cannot hold each other up:
//     the budget cannot deadlock.
//   - A wait is bounded by MemoryWait, far shorter than any timeout the API
//     server can be given for the webhook; a request that cannot have its
//     memory by then is refused at once (HTTP 503, the API server applies the
//     failure policy to that request only).
//   - Each class has its own share and its own queue: a small body never
//     waits behind a large one. The small class's share is sized for every
//     connection the server admits (MaxConnections) to hold one small body
//     and its decoding: pods' reviews are a few KiB. The server's connection limit closes only
//     connections on which no request is being served, so a small body
//     waits only in a race the limit cannot see (a request read into the
//     server's buffers just as its connection was closed), and then for at
//     most MemoryWait.
//   - The server in front of the handler also bounds how long a body may
//     take to arrive (BodyDeadline), so a reservation held by a client that
//     stalls is freed within seconds.
const (
	// MaxConnections is the number of connections the webhook server keeps
	// open at once; the small class's share holds one small body for each.
	MaxConnections = 256
	// SmallBody is the largest body of the small class.
	SmallBody = 64 << 10
	// MediumBody is the largest body of the medium class; larger bodies, up
	// to MaxBodyBytes, are of the large class.
	MediumBody = 1 << 20
	// MemoryWait bounds how long a request waits for its body's memory.
	MemoryWait = 500 * time.Millisecond
)

// BodyBudget bounds the memory all requests' bodies may hold at once: the
// sum of the classes' shares.
const BodyBudget = smallShare + mediumShare + largeShare

const (
	smallShare  = MaxConnections * (smallBuffer + DecodeAllowance) // 32 MiB and 128 KiB
	mediumShare = 16 * MediumBody                                  // 15 bodies of MediumBody
	largeShare  = 32 << 20                                         // five bodies of MaxBodyBytes
)

// budget is the memory of bodies in flight, by class.
type budget struct {
	classes [3]*share
	wait    time.Duration
}

func newBudget(wait time.Duration) *budget {
	return &budget{wait: wait, classes: [3]*share{
		newShare("small", SmallBody, smallShare),
		newShare("medium", MediumBody, mediumShare),
		newShare("large", MaxBodyBytes, largeShare),
	}}
}

// share is one class's memory: a FIFO semaphore of bytes, with what liveness
// needs to tell a busy share from a stuck one.
type share struct {
	name string
	max  int64
	size int64
	sem  *semaphore.Weighted

	mu sync.Mutex
	// refusedSince is when the first request was refused since this share
	// last granted or got back memory; zero when it has not refused since.
	refusedSince time.Time
}

func newShare(name string, max, size int64) *share {
	return &share{name: name, max: max, size: size, sem: semaphore.NewWeighted(size)}
}

// reservation is memory held for one body; release it once the body is no
// longer needed.
type reservation struct {
	share *share
	// bytes is what the share holds for it; limit is the most the body may
	// bring.
	bytes, limit int64
}

// smallBuffer is the capacity of the buffers small bodies are read into:
// the largest small body, and what reading it needs beyond (a final read
// of bytes.MinRead that finds the end).
const smallBuffer = SmallBody + bytes.MinRead

// smallBufs holds the buffers of small bodies, each of exactly smallBuffer
// bytes, so that a buffer reused holds no more than a small body reserves.
var smallBufs = sync.Pool{New: func() any { return bytes.NewBuffer(make([]byte, 0, smallBuffer)) }}

// buffer returns the buffer to read the body into, empty: a reused one for
// a small body (the zero reservation's too), a new one of the body's size
// otherwise. Give it back with putBuffer.
func (r reservation) buffer() *bytes.Buffer {
	if r.limit <= SmallBody {
		buf := smallBufs.Get().(*bytes.Buffer)
		buf.Reset()
		return buf
	}
	return bytes.NewBuffer(make([]byte, 0, r.limit+bytes.MinRead))
}

// putBuffer keeps buf for the next small body when it still has the
// capacity small bodies reserve, and lets any other go.
func putBuffer(buf *bytes.Buffer) {
	if buf.Cap() == smallBuffer {
		smallBufs.Put(buf)
	}
}

// release gives the memory back. The zero reservation holds nothing.
func (r reservation) release() {
	if r.share == nil {
		return
	}
	r.share.sem.Release(r.bytes)
	r.share.progressed()
}

// class returns the share for a body of announced bytes (-1: unknown), the
// bytes to reserve for it (the buffer it will be read into and
// DecodeAllowance), and the most it may bring.
func (b *budget) class(announced int64) (p *share, reserve, limit int64) {
	if announced < 0 {
		announced = MaxBodyBytes
	}
	if announced == 0 {
		return nil, 0, 0
	}
	if small := b.classes[0]; announced <= small.max {
		return small, smallBuffer + DecodeAllowance, announced
	}
	for _, p := range b.classes[1:] {
		if announced <= p.max {
			return p, announced + bytes.MinRead + DecodeAllowance, announced
		}
	}
	return b.classes[len(b.classes)-1], announced + bytes.MinRead + DecodeAllowance, announced
}

// reserve reserves the memory for a body of announced bytes (-1: unknown),
// waiting at most b.wait. It returns how long it waited. A refusal's error
// says how much was asked and what the class holds.
func (b *budget) reserve(ctx context.Context, announced int64, now func() time.Time) (reservation, time.Duration, error) {
	p, n, limit := b.class(announced)
	if p == nil {
		return reservation{}, 0, nil
	}
	if p.sem.TryAcquire(n) {
		p.progressed()
		return reservation{share: p, bytes: n, limit: limit}, 0, nil
	}
	start := now()
	wctx, cancel := context.WithTimeout(ctx, b.wait)
	defer cancel()
	err := p.sem.Acquire(wctx, n)
	waited := now().Sub(start)
	memoryWait.WithLabelValues(p.name).Observe(waited.Seconds())
	if err != nil && ctx.Err() != nil {
		return reservation{}, waited, fmt.Errorf("request ended while waiting for memory for its body: %w", ctx.Err())
	}
	if err != nil {
		p.refused(start)
		memoryRefused.WithLabelValues(p.name).Inc()
		return reservation{}, waited, fmt.Errorf("no memory for a body of %d bytes within %s: the %s bodies' share of %d bytes is held by other requests; try again",
			limit, b.wait, p.name, p.size)
	}
	p.progressed()
	return reservation{share: p, bytes: n, limit: limit}, waited, nil
}

func (p *share) progressed() {
	p.mu.Lock()
	p.refusedSince = time.Time{}
	p.mu.Unlock()
}

func (p *share) refused(at time.Time) {
	p.mu.Lock()
	if p.refusedSince.IsZero() {
		p.refusedSince = at
	}
	p.mu.Unlock()
}

// stuck returns the first class that has refused every request for memory
// and neither granted nor got back any since longer than bound before now:
// its memory is held by requests that do not end.
func (b *budget) stuck(now time.Time, bound time.Duration) error {
	for _, p := range b.classes {
		p.mu.Lock()
		since := p.refusedSince
		p.mu.Unlock()
		if !since.IsZero() && now.Sub(since) > bound {
			return fmt.Errorf("the %s bodies' share has refused every request and freed nothing for %s", p.name, now.Sub(since).Round(time.Second))
		}
	}
	return nil
}
