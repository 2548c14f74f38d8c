package process

import (
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestFreePortIsOutsideTheEphemeralRange(t *testing.T) {
	low := ephemeralLow()
	if low < 11000 {
		t.Skipf("the ephemeral range starts at %d: no room below it", low)
	}
	for range 20 {
		port, err := FreePort()
		require.NoError(t, err)
		require.Less(t, port, low, "an ephemeral port can be taken by an outgoing connection once its server stops")
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		require.NoError(t, err)
		require.NoError(t, l.Close())
	}
}
