package hostile

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"tally.dev/tally/pkg/mutate"
)

// bodyClass is a kind of hostile review body: unit repeated fills it to the
// body limit, inside the frame at %s.
type bodyClass struct {
	name, frame, unit string
}

// hostileClasses are the bodies built to make decoding cost many times
// their size: huge arrays of empty elements where the webhook reads lists,
// deep nesting, many keys, long strings, escapes, numbers, duplicate keys.
var hostileClasses = []bodyClass{
	{"empty owner references", `"ownerReferences":[%s{}]`, `{},`},
	{"empty finalizers", `"finalizers":[%s""]`, `"",`},
	{"duplicate tally.dev/ keys", `"labels":{%s"tally.dev/x":""}`, `"tally.dev/x":"",`},
	{"many tally.dev/ keys", `"annotations":{%s"tally.dev/end":""}`, ""},
	{"many other keys", `"annotations":{%s"end":""}`, ""},
	{"a long string", `"labels":{"tally.dev/parent-uid":"%s"}`, `a`},
	{"escapes", `"annotations":{"tally.dev/completion-intent":"%s"}`, `\u00e9`},
	{"deep nesting", `"x":%s`, `[`},
	{"numbers", `"x":[%s1]`, `-1.5e308,`},
}

// body returns the class's review, of about the body limit.
func (c bodyClass) body() []byte {
	const size = mutate.MaxBodyBytes - 4<<10
	var fill string
	switch c.unit {
	case "":
		var b strings.Builder
		prefix := map[bool]string{true: "tally.dev/", false: ""}[strings.Contains(c.name, "tally.dev/")]
		for i := 0; b.Len() < size; i++ {
			fmt.Fprintf(&b, `"%sk%d":"",`, prefix, i)
		}
		fill = b.String()
	default:
		fill = strings.Repeat(c.unit, size/len(c.unit))
	}
	meta := fmt.Sprintf(c.frame, fill)
	return fmt.Appendf(nil, `{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"hostile",
"kind":{"group":"","version":"v1","kind":"Pod"},"namespace":"ns","operation":"CREATE","userInfo":{"username":"mallory"},
"object":{"apiVersion":"v1","kind":"Pod","metadata":{"name":"p","namespace":"ns",%s}}}}`, meta)
}

// memoryBound is what the webhook may hold above idle: the bodies' budget
// (their buffers and what decoding them keeps) and the buffers of
// MaxConnections connections (TLS and HTTP, under 128 KiB each).
const memoryBound = mutate.BodyBudget + mutate.MaxConnections*128<<10

// TestHostileBodies: four bodies of each hostile class at once, at the body
// limit, while a client reviews as the API server does on kept-alive
// connections. Every review is answered within 5 s, and the webhook's peak
// RSS stays within idle and memoryBound. make test runs the classes that
// once took the webhook past its bound; make test-all runs every class.
func TestHostileBodies(t *testing.T) {
	if _, err := os.Stat("/proc/self/status"); err != nil {
		t.Skip("needs /proc to read the webhook's memory")
	}
	classes := hostileClasses
	if testing.Short() {
		classes = classes[:2]
	}
	wh := startWebhook(t, false)
	idle := rssBytes(t, wh.proc.Pid())
	reviewer := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: wh.tls, MaxIdleConnsPerHost: 4}}
	attacker := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{TLSClientConfig: wh.tls}}
	for _, c := range classes {
		body := c.body()
		// Each class's own peak: the kernel resets VmHWM to the RSS of now.
		require.NoError(t, os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", wh.proc.Pid()), []byte("5"), 0), "resetting the peak RSS")
		stop := make(chan struct{})
		var slowest time.Duration
		var failed []error
		var reviews sync.WaitGroup
		reviews.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				d, err := wh.admit(reviewer, i)
				if err != nil {
					failed = append(failed, err)
				}
				slowest = max(slowest, d)
				time.Sleep(20 * time.Millisecond)
			}
		})
		var statuses []int
		var mu sync.Mutex
		var attacks sync.WaitGroup
		begin := time.Now()
		for range 4 {
			attacks.Go(func() {
				resp, err := attacker.Post("https://"+wh.addr+"/mutate-pods", "application/json", bytes.NewReader(body))
				status := 0
				if err == nil {
					status = resp.StatusCode
					resp.Body.Close()
				}
				mu.Lock()
				statuses = append(statuses, status)
				mu.Unlock()
			})
		}
		attacks.Wait()
		took := time.Since(begin)
		close(stop)
		reviews.Wait()
		peak := procStatus(t, wh.proc.Pid(), "VmHWM:")
		t.Logf("%s: 4 bodies of %d KiB answered %v in %s; RSS idle %d MiB, peak %d MiB (bound %d MiB above idle); reviews meanwhile: slowest %s, %d failed",
			c.name, len(body)>>10, statuses, took.Round(time.Millisecond), idle>>20, peak>>20, memoryBound>>20, slowest.Round(time.Millisecond), len(failed))
		assert.Less(t, peak-idle, int64(memoryBound), "%s: peak RSS above idle", c.name)
		assert.Empty(t, failed, "%s: reviews failed", c.name)
		assert.Less(t, slowest, 5*time.Second, "%s: a review took longer than 5 s", c.name)
		for _, s := range statuses {
			assert.Contains(t, []int{http.StatusOK, http.StatusServiceUnavailable}, s, "%s: each body is answered (a refusal in an AdmissionReview, or 503 when its memory is taken)", c.name)
		}
	}
}

// TestTrickleHoldsNoSlot: 300 connections (more than the webhook keeps
// open) are each answered once and then sent one byte of a next request,
// which they never finish, while a client reviews on a kept-alive
// connection and on new ones. A connection whose next request has begun is
// protected for the read-header timeout at most, so the trickle holds no
// slot for long: no review fails or takes more than 5 s.
func TestTrickleHoldsNoSlot(t *testing.T) {
	wh := startWebhook(t, false)
	kept := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: wh.tls}}
	fresh := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: wh.tls, DisableKeepAlives: true}}
	_, err := wh.admit(kept, 0)
	require.NoError(t, err, "the kept-alive connection, before the trickle")

	stop := make(chan struct{})
	var latencies []time.Duration
	var failed []error
	var reviews sync.WaitGroup
	reviews.Go(func() {
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			for _, c := range []*http.Client{kept, fresh} {
				d, err := wh.admit(c, i)
				if err != nil {
					failed = append(failed, err)
					continue
				}
				latencies = append(latencies, d)
			}
		}
	})

	trickling := make([]net.Conn, 300)
	defer func() {
		for _, c := range trickling {
			if c != nil {
				c.Close()
			}
		}
	}()
	var opened sync.WaitGroup
	var answeredOnce atomic.Int32
	for i := range trickling {
		opened.Go(func() {
			c, err := tls.Dial("tcp", wh.addr, wh.tls)
			if err != nil {
				return
			}
			trickling[i] = c
			body := review(200_000 + i)
			if _, err := fmt.Fprintf(c, "POST /mutate-pods HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
				return
			}
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			if answered(http.ReadResponse(bufio.NewReader(c), nil)) != nil {
				return
			}
			answeredOnce.Add(1)
			_, _ = c.Write([]byte("P"))
		})
	}
	opened.Wait()
	time.Sleep(10 * time.Second)
	close(stop)
	reviews.Wait()
	p50, p99 := percentiles(latencies)
	t.Logf("300 connections, %d answered once and then trickling a next request: %d reviews on a kept-alive and on new connections meanwhile, p50 %s, p99 %s, max %s, %d failed",
		answeredOnce.Load(), len(latencies), p50, p99, slices.Max(latencies), len(failed))
	assert.Empty(t, failed)
	assert.Less(t, slices.Max(latencies), 5*time.Second)
}
