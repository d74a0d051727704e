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

	"github.com/durable-runtime/durable/executors-go/executor"
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
	build := exec.Command(goTool(), "build", "-o", demoBin, ".")
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

type frameOrErr struct {
	frame *pb.ExecutorFrame
	err   error
}

// demo is one demo-executor process, started as the leader of its own process
// group, with the test playing the supervisor.
type demo struct {
	t      *testing.T
	cmd    *exec.Cmd
	pgid   int
	stdin  *os.File
	frames chan frameOrErr
	raw    *capture // every byte the executor wrote on stdout
	rest   chan []byte
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
	d := &demo{
		t: t, cmd: cmd, stdin: stdinW,
		frames: make(chan frameOrErr, 4096),
		raw:    &capture{max: 1 << 20},
		rest:   make(chan []byte, 1),
		stderr: &capture{max: 4 << 20},
		exited: make(chan struct{}),
	}
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
	go func() {
		fr := executor.NewFrameReader(io.TeeReader(stdoutR, d.raw), 0)
		for {
			f := &pb.ExecutorFrame{}
			err := fr.Read(f)
			d.frames <- frameOrErr{f, err}
			if err != nil {
				rest, _ := io.ReadAll(fr.Buffered())
				d.rest <- rest
				return
			}
		}
	}()
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
	d.stdin.Close()
	if code := d.wait(); code != 0 {
		d.t.Fatalf("exit status %d after stdin closed, want 0 (stderr: %s)", code, tail(d.stderr.String()))
	}
	if err := d.endOfStream(); err != io.EOF {
		d.t.Fatalf("stdout ended with %v, want a clean EOF", err)
	}
}

func tail(s string) string {
	if len(s) > 2000 {
		return "..." + s[len(s)-2000:]
	}
	return s
}

func (d *demo) send(f *pb.SupervisorFrame) {
	d.t.Helper()
	b, err := executor.MarshalFrame(f)
	if err != nil {
		d.t.Fatal(err)
	}
	if _, err := d.stdin.Write(b); err != nil {
		d.t.Fatalf("writing to the demo executor: %v", err)
	}
}

func (d *demo) sendJob(j *pb.Job) {
	d.t.Helper()
	d.send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: j}})
}

func (d *demo) sendCancel(jobID string) {
	d.t.Helper()
	d.send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Cancel{Cancel: &pb.Cancel{
		JobId: jobID, Reason: pb.CancelReason_CANCEL_REASON_REQUESTED, GraceMs: 1000, Message: "test cancel",
	}}})
}

func (d *demo) next() *pb.ExecutorFrame {
	d.t.Helper()
	select {
	case r := <-d.frames:
		if r.err != nil {
			d.t.Fatalf("reading the next frame: %v (stderr: %s)", r.err, tail(d.stderr.String()))
		}
		return r.frame
	case <-time.After(waitTimeout):
		d.t.Fatalf("no frame within %s (stderr: %s)", waitTimeout, tail(d.stderr.String()))
	}
	return nil
}

// endOfStream returns the error that ends stdout (io.EOF when clean).
func (d *demo) endOfStream() error {
	d.t.Helper()
	select {
	case r := <-d.frames:
		if r.err == nil {
			d.t.Fatalf("expected the end of stdout, got frame %v", r.frame)
		}
		return r.err
	case <-time.After(waitTimeout):
		d.t.Fatalf("stdout did not end within %s", waitTimeout)
	}
	return nil
}

func (d *demo) noFrame(dur time.Duration) {
	d.t.Helper()
	select {
	case r := <-d.frames:
		d.t.Fatalf("expected nothing on stdout for %s, got %v (err %v)", dur, r.frame, r.err)
	case <-time.After(dur):
	}
}

func (d *demo) hello() *pb.Hello {
	d.t.Helper()
	f := d.next()
	if f.GetHello() == nil {
		d.t.Fatalf("first frame is not a hello: %v", f)
	}
	return f.GetHello()
}

func (d *demo) event(jobID string, seq uint64, kind pb.EventKind) *pb.ProgressEvent {
	d.t.Helper()
	f := d.next()
	ev := f.GetEvent()
	if ev == nil || ev.GetJobId() != jobID || ev.GetSequence() != seq || ev.GetKind() != kind {
		d.t.Fatalf("want %s event for job %q seq %d, got %v", kind, jobID, seq, f)
	}
	return ev
}

func (d *demo) started(jobID string) {
	d.t.Helper()
	d.event(jobID, 1, pb.EventKind_EVENT_KIND_ACCEPTED)
	d.event(jobID, 2, pb.EventKind_EVENT_KIND_RUNNING)
}

func (d *demo) result(jobID string, seq uint64) *pb.JobResult {
	d.t.Helper()
	f := d.next()
	r := f.GetResult()
	if r == nil || r.GetJobId() != jobID || r.GetSequence() != seq {
		d.t.Fatalf("want result for job %q seq %d, got %v (stderr: %s)", jobID, seq, f, tail(d.stderr.String()))
	}
	return r
}

func (d *demo) jobError(jobID string, seq uint64, code string) *pb.JobError {
	d.t.Helper()
	f := d.next()
	e := f.GetError()
	if e == nil || e.GetJobId() != jobID || e.GetSequence() != seq || e.GetCode() != code {
		d.t.Fatalf("want error %s for job %q seq %d, got %v", code, jobID, seq, f)
	}
	return e
}

// runOne starts a demo executor, runs one job to its terminal and exits cleanly;
// it returns the frames after RUNNING (events, then the terminal).
func runOne(t *testing.T, j *pb.Job, env ...string) []*pb.ExecutorFrame {
	t.Helper()
	d := startDemo(t, env...)
	d.hello()
	d.sendJob(j)
	d.started(j.GetJobId())
	var frames []*pb.ExecutorFrame
	for {
		f := d.next()
		frames = append(frames, f)
		if f.GetResult() != nil || f.GetError() != nil {
			break
		}
	}
	d.closeAndExpectExit()
	return frames
}

func newJob(id, kind, input string) *pb.Job {
	return &pb.Job{
		JobId: id, WorkflowRunId: "wr-1", StepRunId: "sr-" + id, IdempotencyKey: "idem-" + id,
		ExecutorKind: "go", Kind: kind, Attempt: 1, Input: []byte(input),
	}
}
