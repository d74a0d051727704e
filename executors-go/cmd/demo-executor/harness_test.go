package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/durable-runtime/durable/executors-go/executortest"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// waitTimeout bounds every wait; healthy steps take milliseconds.
const waitTimeout = 10 * time.Second

// demoBin is the demo executor binary TestMain builds.
var demoBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "demo-executor-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	demoBin = filepath.Join(dir, "demo-executor")
	// -buildvcs=false: the binary's SDK version is then "devel", as the test
	// binary's is (TestHello compares them).
	build := exec.Command(goTool(), "build", "-buildvcs=false", "-o", demoBin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building the demo executor: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	return filepath.Join(runtime.GOROOT(), "bin", "go")
}

// capture is a goroutine-safe writer that keeps the first max bytes and counts
// all of them.
type capture struct {
	mu    sync.Mutex
	buf   bytes.Buffer
	total int64
	max   int
}

func (c *capture) Write(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.total += int64(len(b))
	if room := c.max - c.buf.Len(); room > 0 {
		c.buf.Write(b[:min(room, len(b))])
	}
	return len(b), nil
}

func (c *capture) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.buf.String()
}

func (c *capture) Total() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.total
}

// demo is one demo-executor process, started as the leader of its own process
// group; its embedded Conn plays the supervisor on its stdin and stdout.
type demo struct {
	*executortest.Conn
	t      *testing.T
	cmd    *exec.Cmd
	pgid   int
	stdin  *os.File
	stderr *capture

	waitOnce sync.Once
	exited   chan struct{}
	waitErr  error
}

func startDemo(t *testing.T, env ...string) *demo {
	t.Helper()
	cmd := exec.Command(demoBin)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DEMO_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	stdinR, stdinW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	stdoutR, stdoutW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	d := &demo{t: t, cmd: cmd, stdin: stdinW, stderr: &capture{max: 4 << 20}, exited: make(chan struct{})}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdinR, stdoutW, d.stderr
	cmd.WaitDelay = 2 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stdinR.Close()
	stdoutW.Close()
	d.pgid = cmd.Process.Pid
	t.Cleanup(func() {
		d.stdin.Close()
		select {
		case <-d.exited:
		default:
			// Kill the whole group (grandchildren included) before the leader is reaped.
			_ = syscall.Kill(-d.pgid, syscall.SIGKILL)
			d.startWait()
			<-d.exited
		}
		stdoutR.Close()
	})
	d.Conn = executortest.New(t, stdinW, stdoutR)
	d.Conn.Timeout = waitTimeout
	d.Conn.Describe = func() string { return "stderr: " + tail(d.stderr.String()) }
	return d
}

func (d *demo) startWait() {
	d.waitOnce.Do(func() {
		go func() {
			d.waitErr = d.cmd.Wait()
			close(d.exited)
		}()
	})
}

// wait waits for the process to exit and returns its exit code.
func (d *demo) wait() int {
	d.t.Helper()
	d.startWait()
	select {
	case <-d.exited:
	case <-time.After(waitTimeout):
		d.t.Fatalf("the demo executor did not exit within %s (stderr: %s)", waitTimeout, tail(d.stderr.String()))
	}
	var ee *exec.ExitError
	if errors.As(d.waitErr, &ee) {
		return ee.ExitCode()
	}
	if d.waitErr != nil {
		d.t.Fatalf("wait: %v", d.waitErr)
	}
	return 0
}

// closeAndExpectExit closes stdin and expects a clean exit 0.
func (d *demo) closeAndExpectExit() {
	d.t.Helper()
	d.CloseStdin()
	if code := d.wait(); code != 0 {
		d.t.Fatalf("exit status %d after stdin closed, want 0 (stderr: %s)", code, tail(d.stderr.String()))
	}
	if err := d.EndOfStream(); err != io.EOF {
		d.t.Fatalf("stdout ended with %v, want a clean EOF", err)
	}
}

func tail(s string) string {
	if len(s) > 2000 {
		return "..." + s[len(s)-2000:]
	}
	return s
}

// runOne starts a demo executor, runs one job to its terminal and exits cleanly;
// it returns the frames after RUNNING (events, then the terminal).
func runOne(t *testing.T, j *pb.Job, env ...string) []*pb.ExecutorFrame {
	t.Helper()
	d := startDemo(t, env...)
	d.Hello()
	frames := d.Run(j)
	d.closeAndExpectExit()
	return frames
}

func newJob(id, kind, input string) *pb.Job { return executortest.NewJob(id, kind, input) }
