package framework

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Flood is what a LargeBodyFlood sent and was answered.
type Flood struct {
	// Requests is how many requests the flood began.
	Requests int32
	// Refused is how many the webhook refused at once for memory (503).
	Refused int32
	// FirstRefused is when the first was refused (zero if none was).
	FirstRefused time.Time
}

// LargeBodyFlood has clients connections to the webhook at addr each
// announce a 6 MiB admission body and trickle 2 MiB of it, 64 KiB every
// 50 ms, again and again until ctx is done: the clients hold the large
// bodies' memory as long as the webhook lets them.
func LargeBodyFlood(ctx context.Context, addr string, conf *tls.Config, clients int) Flood {
	var requests, refused atomic.Int32
	var first atomic.Int64
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			for ctx.Err() == nil {
				c, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, conf)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				requests.Add(1)
				if trickle(ctx, c) {
					refused.Add(1)
					first.CompareAndSwap(0, time.Now().UnixNano())
				}
			}
		})
	}
	wg.Wait()
	f := Flood{Requests: requests.Load(), Refused: refused.Load()}
	if n := first.Load(); n != 0 {
		f.FirstRefused = time.Unix(0, n)
	}
	return f
}

// trickle sends one large body's request on c, slowly, closes c, and
// reports whether the webhook refused it with 503.
func trickle(ctx context.Context, c net.Conn) bool {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	if _, err := fmt.Fprintf(c, "POST /mutate-pods HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n", 6<<20); err != nil {
		return false
	}
	answer := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(c).ReadString('\n')
		answer <- line
	}()
	chunk := bytes.Repeat([]byte(" "), 64<<10)
	for sent := 0; sent < 2<<20 && ctx.Err() == nil; sent += len(chunk) {
		if _, err := c.Write(chunk); err != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return strings.Contains(<-answer, " 503 ")
}
