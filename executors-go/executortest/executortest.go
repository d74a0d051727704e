// Package executortest plays the supervisor's side of the executor protocol
// in tests. Start runs an *executor.Executor in-process over pipes; New
// attaches to the standard streams of an executor running elsewhere (a child
// process). Either way the test sends jobs, cancels and shutdowns, and reads
// the frames that come back with methods that fail the test on anything
// unexpected (a wrong frame, a broken stream, nothing within Conn.Timeout).
//
//	ex := executor.New(executor.Options{})
//	ex.Handle("greet", greet)
//	c := executortest.Start(t, ex)
//	c.Hello()
//	frames := c.Run(executortest.NewJob("j1", "greet", `{"name":"Ada"}`))
//	// frames: the events after RUNNING, then the terminal
package executortest

import (
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// DefaultTimeout is a new Conn's Timeout.
const DefaultTimeout = 5 * time.Second

// maxRaw is how many bytes of the executor's output Raw keeps.
const maxRaw = 64 << 20

// Conn is the supervisor's end of one executor's frame streams.
type Conn struct {
	// Timeout bounds every wait: for a frame, for a write to be read, for
	// Serve to return. DefaultTimeout unless changed.
	Timeout time.Duration
	// Describe, when set, is appended to every failure's message: say, the
	// tail of a child executor's stderr.
	Describe func() string

	t     testing.TB
	stdin io.WriteCloser

	mu     sync.Mutex
	queue  []frameOrErr
	notify chan struct{} // a frame was queued
	raw    []byte
	total  int64

	served   chan error // Start only: Serve's result
	waited   bool
	serveErr error
}

type frameOrErr struct {
	frame *pb.ExecutorFrame
	err   error
}

// Start runs ex.Serve in a goroutine, on pipes whose other ends the returned
// Conn holds. The test's cleanup closes the executor's stdin and checks that
// Serve returns within Timeout.
func Start(t testing.TB, ex *executor.Executor) *Conn {
	t.Helper()
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	c := newConn(t, inW)
	c.served = make(chan error, 1)
	go func() {
		err := ex.Serve(inR, outW)
		outW.Close()
		c.served <- err
	}()
	go c.read(outR)
	t.Cleanup(func() {
		inW.Close()
		if !c.waited {
			select {
			case err := <-c.served:
				c.waited, c.serveErr = true, err
			case <-time.After(c.Timeout):
				t.Errorf("executortest: Serve did not return within %s of stdin closing", c.Timeout)
			}
		}
		outR.Close()
	})
	return c
}

// New plays the supervisor on an executor's stdin and stdout, say the pipes
// of a child process. The test's cleanup closes stdin; the caller owns the
// process (and so stdout's end of stream).
func New(t testing.TB, stdin io.WriteCloser, stdout io.Reader) *Conn {
	t.Helper()
	c := newConn(t, stdin)
	go c.read(stdout)
	t.Cleanup(func() { stdin.Close() })
	return c
}

func newConn(t testing.TB, stdin io.WriteCloser) *Conn {
	return &Conn{Timeout: DefaultTimeout, t: t, stdin: stdin, notify: make(chan struct{}, 1)}
}

// read decodes the executor's output until it ends or breaks, then keeps
// draining it (into Raw) so that the executor never blocks on a full pipe.
func (c *Conn) read(stdout io.Reader) {
	tee := io.TeeReader(stdout, (*rawWriter)(c))
	fr := executor.NewFrameReader(tee, 0)
	for {
		f := &pb.ExecutorFrame{}
		err := fr.Read(f)
		c.mu.Lock()
		c.queue = append(c.queue, frameOrErr{f, err})
		c.mu.Unlock()
		select {
		case c.notify <- struct{}{}:
		default:
		}
		if err != nil {
			_, _ = io.Copy(io.Discard, tee)
			return
		}
	}
}

type rawWriter Conn

func (w *rawWriter) Write(b []byte) (int, error) {
	c := (*Conn)(w)
	c.mu.Lock()
	defer c.mu.Unlock()
	c.total += int64(len(b))
	if room := maxRaw - len(c.raw); room > 0 {
		c.raw = append(c.raw, b[:min(room, len(b))]...)
	}
	return len(b), nil
}

// Raw returns a copy of the bytes the executor wrote so far (the first 64
// MiB), frames or not: for tests of broken streams.
func (c *Conn) Raw() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]byte(nil), c.raw...)
}

// pop returns the next frame (or the stream's end), waiting up to d; ok is
// false when nothing came.
func (c *Conn) pop(d time.Duration) (f frameOrErr, ok bool) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		c.mu.Lock()
		if len(c.queue) > 0 {
			f = c.queue[0]
			c.queue = c.queue[1:]
			c.mu.Unlock()
			return f, true
		}
		c.mu.Unlock()
		select {
		case <-c.notify:
		case <-timer.C:
			return f, false
		}
	}
}

// Send writes one supervisor frame to the executor's stdin.
func (c *Conn) Send(f *pb.SupervisorFrame) {
	c.t.Helper()
	b, err := executor.MarshalFrame(f)
	if err != nil {
		c.fatalf("encoding %v: %v", f, err)
	}
	c.SendRaw(b)
}

// SendRaw writes b verbatim to the executor's stdin (broken frames, say).
func (c *Conn) SendRaw(b []byte) {
	c.t.Helper()
	done := make(chan error, 1)
	go func() { _, err := c.stdin.Write(b); done <- err }()
	select {
	case err := <-done:
		if err != nil {
			c.fatalf("writing to the executor's stdin: %v", err)
		}
	case <-time.After(c.Timeout):
		c.fatalf("the executor did not read its stdin within %s", c.Timeout)
	}
}

// SendJob sends a Job.
func (c *Conn) SendJob(j *pb.Job) {
	c.t.Helper()
	c.Send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: j}})
}

// SendCancel sends a Cancel.
func (c *Conn) SendCancel(cancel *pb.Cancel) {
	c.t.Helper()
	c.Send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Cancel{Cancel: cancel}})
}

// Cancel requests the cancellation of a job, as an operator would: reason
// REQUESTED, a grace of one second.
func (c *Conn) Cancel(jobID string) {
	c.t.Helper()
	c.SendCancel(&pb.Cancel{JobId: jobID, Reason: pb.CancelReason_CANCEL_REASON_REQUESTED, GraceMs: 1000, Message: "cancelled by the test"})
}

// Shutdown sends a Shutdown.
func (c *Conn) Shutdown(reason string) {
	c.t.Helper()
	c.Send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Shutdown{Shutdown: &pb.Shutdown{Reason: reason}}})
}

// CloseStdin closes the executor's stdin: the end of its input.
func (c *Conn) CloseStdin() { c.stdin.Close() }

// Next returns the next frame from the executor.
func (c *Conn) Next() *pb.ExecutorFrame {
	c.t.Helper()
	f, ok := c.pop(c.Timeout)
	if !ok {
		c.fatalf("no frame from the executor within %s", c.Timeout)
	}
	if f.err != nil {
		c.fatalf("reading the executor's next frame: %v", f.err)
	}
	return f.frame
}

// EndOfStream waits for the end of the executor's output and returns what
// ended it: io.EOF when it ended cleanly between frames, otherwise the
// framing error (executor.ErrTruncatedFrame, ...). A frame instead fails the
// test.
func (c *Conn) EndOfStream() error {
	c.t.Helper()
	f, ok := c.pop(c.Timeout)
	switch {
	case !ok:
		c.fatalf("the executor's output did not end within %s", c.Timeout)
	case f.err == nil:
		c.fatalf("expected the end of the executor's output, got %v", f.frame)
	}
	return f.err
}

// NoFrame asserts that the executor writes nothing for d.
func (c *Conn) NoFrame(d time.Duration) {
	c.t.Helper()
	if f, ok := c.pop(d); ok {
		c.fatalf("expected nothing from the executor for %s, got %v (err %v)", d, f.frame, f.err)
	}
}

// Hello returns the next frame, which must be a Hello.
func (c *Conn) Hello() *pb.Hello {
	c.t.Helper()
	f := c.Next()
	if f.GetHello() == nil {
		c.fatalf("want a hello, got %v", f)
	}
	return f.GetHello()
}

// Event returns the next frame, which must be an event of that job, sequence
// and kind.
func (c *Conn) Event(jobID string, seq uint64, kind pb.EventKind) *pb.ProgressEvent {
	c.t.Helper()
	f := c.Next()
	ev := f.GetEvent()
	if ev == nil || ev.GetJobId() != jobID || ev.GetSequence() != seq || ev.GetKind() != kind {
		c.fatalf("want a %s event for job %q with sequence %d, got %v", kind, jobID, seq, f)
	}
	return ev
}

// Started consumes the ACCEPTED (sequence 1) and RUNNING (2) events every
// executed job begins with.
func (c *Conn) Started(jobID string) {
	c.t.Helper()
	c.Event(jobID, 1, pb.EventKind_EVENT_KIND_ACCEPTED)
	c.Event(jobID, 2, pb.EventKind_EVENT_KIND_RUNNING)
}

// Result returns the next frame, which must be that job's JobResult with that
// sequence.
func (c *Conn) Result(jobID string, seq uint64) *pb.JobResult {
	c.t.Helper()
	f := c.Next()
	r := f.GetResult()
	if r == nil || r.GetJobId() != jobID || r.GetSequence() != seq {
		c.fatalf("want a result for job %q with sequence %d, got %v", jobID, seq, f)
	}
	return r
}

// JobError returns the next frame, which must be that job's JobError with that
// sequence and code.
func (c *Conn) JobError(jobID string, seq uint64, code string) *pb.JobError {
	c.t.Helper()
	f := c.Next()
	e := f.GetError()
	if e == nil || e.GetJobId() != jobID || e.GetSequence() != seq || e.GetCode() != code {
		c.fatalf("want error %s for job %q with sequence %d, got %v", code, jobID, seq, f)
	}
	return e
}

// UntilTerminal returns the frames up to and including the job's terminal
// (JobResult or JobError).
func (c *Conn) UntilTerminal(jobID string) []*pb.ExecutorFrame {
	c.t.Helper()
	var frames []*pb.ExecutorFrame
	for {
		f := c.Next()
		frames = append(frames, f)
		if r, e := f.GetResult(), f.GetError(); (r != nil && r.GetJobId() == jobID) || (e != nil && e.GetJobId() == jobID) {
			return frames
		}
	}
}

// Run sends j, consumes its ACCEPTED and RUNNING events and returns the frames
// that follow, the terminal last.
func (c *Conn) Run(j *pb.Job) []*pb.ExecutorFrame {
	c.t.Helper()
	c.SendJob(j)
	c.Started(j.GetJobId())
	return c.UntilTerminal(j.GetJobId())
}

// Wait waits for Serve to return and returns its error (Start only).
func (c *Conn) Wait() error {
	c.t.Helper()
	if c.served == nil {
		c.fatalf("Wait on a Conn that New made: the caller owns the executor")
	}
	if c.waited {
		return c.serveErr
	}
	select {
	case err := <-c.served:
		c.waited, c.serveErr = true, err
		return err
	case <-time.After(c.Timeout):
		c.fatalf("Serve did not return within %s", c.Timeout)
	}
	return nil
}

// StillServing asserts that Serve has not returned after d (Start only).
func (c *Conn) StillServing(d time.Duration) {
	c.t.Helper()
	if c.served == nil {
		c.fatalf("StillServing on a Conn that New made")
	}
	if c.waited {
		c.fatalf("Serve already returned: %v", c.serveErr)
	}
	select {
	case err := <-c.served:
		c.waited, c.serveErr = true, err
		c.fatalf("Serve returned early: %v", err)
	case <-time.After(d):
	}
}

// NewJob returns a first attempt of a job for executor_kind "go" with the
// given id, kind and input JSON, and ids derived from id.
func NewJob(id, kind, input string) *pb.Job {
	return &pb.Job{
		JobId: id, WorkflowRunId: "wr-" + id, StepRunId: "sr-" + id, IdempotencyKey: "idem-" + id,
		ExecutorKind: "go", Kind: kind, Attempt: 1, Input: []byte(input),
	}
}

func (c *Conn) fatalf(format string, args ...any) {
	c.t.Helper()
	msg := "executortest: " + fmt.Sprintf(format, args...)
	if c.Describe != nil {
		msg += "\n" + c.Describe()
	}
	c.t.Fatal(msg)
}
