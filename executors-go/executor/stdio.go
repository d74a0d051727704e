package executor

import (
	"os"
	"sync"
)

// claimed holds the frame streams once ClaimStdio has taken them.
var claimed struct {
	mu      sync.Mutex
	in, out *os.File
}

// ClaimStdio takes the process's standard streams for frames and returns
// the streams they now travel on: it moves stdout to a private descriptor
// that carries frames only and points fd 1 at stderr, so that os.Stdout,
// fmt.Println and child processes inheriting fd 1 write to stderr; stdin
// likewise moves to a private descriptor, and fd 0 reads /dev/null. (On
// systems without dup2 it returns os.Stdin and os.Stdout as they are.)
//
// Run calls it. A program that may print anything before Run (an init
// function, a library announcing itself, a configuration dump) calls it
// first thing in main: bytes already written to the real stdout cannot be
// taken back, and the supervisor would read them as a malformed frame ahead
// of the hello. Later calls, Run's included, return the same streams; a
// failure is not remembered (the next call tries again), and Run reports it
// with exit code 2, so main may ignore the error:
//
//	func main() {
//		executor.ClaimStdio() // before anything can print
//		...
//		os.Exit(ex.Run())
//	}
func ClaimStdio() (in, out *os.File, err error) {
	claimed.mu.Lock()
	defer claimed.mu.Unlock()
	if claimed.out == nil {
		in, out, err := takeStdio()
		if err != nil {
			return nil, nil, err
		}
		claimed.in, claimed.out = in, out
	}
	return claimed.in, claimed.out, nil
}
