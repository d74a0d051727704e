package executor

import (
	"errors"
	"io"
	"log"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// waitTimeout bounds every wait in these tests; a healthy run takes milliseconds.
const waitTimeout = 5 * time.Second

// quietLogger discards the SDK's diagnostics during tests.
var quietLogger = log.New(io.Discard, "", 0)

type readResult struct {
	frame *pb.ExecutorFrame
	err   error
}

// harness drives Executor.Serve through in-memory pipes, playing the supervisor.
type harness struct {
	t        *testing.T
	in       *io.PipeWriter
	frames   chan readResult
	served   chan error
	serveErr *error
}

func newExecutor(opts Options) *Executor {
	if opts.Logger == nil {
		opts.Logger = quietLogger
	}
	if opts.ExecutorKind == "" {
		opts.ExecutorKind = "go"
	}
	return New(opts)
}

// serve starts ex.Serve and a reader of its frames. Cleanup closes stdin and
// waits for Serve to return.
func serve(t *testing.T, ex *Executor) *harness {
	t.Helper()
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	h := &harness{t: t, in: inW, frames: make(chan readResult, 4096), served: make(chan error, 1)}
	go func() {
		err := ex.Serve(inR, outW)
		outW.Close()
		h.served <- err
	}()
	go func() {
		fr := NewFrameReader(outR, 0)
		for {
			f := &pb.ExecutorFrame{}
			err := fr.Read(f)
			h.frames <- readResult{f, err}
			if err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		inW.Close()
		if h.serveErr == nil {
			select {
			case <-h.served:
			case <-time.After(waitTimeout):
				t.Errorf("Serve did not return within %s of stdin closing", waitTimeout)
			}
		}
		outR.Close()
	})
	return h
}

func (h *harness) send(f *pb.SupervisorFrame) {
	h.t.Helper()
	b, err := MarshalFrame(f)
	if err != nil {
		h.t.Fatalf("marshal: %v", err)
	}
	h.sendRaw(b)
}

func (h *harness) sendRaw(b []byte) {
	h.t.Helper()
	done := make(chan error, 1)
	go func() { _, err := h.in.Write(b); done <- err }()
	select {
	case err := <-done:
		if err != nil {
			h.t.Fatalf("writing to the executor's stdin: %v", err)
		}
	case <-time.After(waitTimeout):
		h.t.Fatalf("the executor did not read its stdin within %s", waitTimeout)
	}
}

func (h *harness) sendJob(j *pb.Job) {
	h.t.Helper()
	h.send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: j}})
}

func (h *harness) sendCancel(c *pb.Cancel) {
	h.t.Helper()
	h.send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Cancel{Cancel: c}})
}

func (h *harness) closeStdin() { h.in.Close() }

// next returns the next executor frame, failing the test on a read error or
// after waitTimeout.
func (h *harness) next() *pb.ExecutorFrame {
	h.t.Helper()
	select {
	case r := <-h.frames:
		if r.err != nil {
			h.t.Fatalf("reading the next executor frame: %v", r.err)
		}
		return r.frame
	case <-time.After(waitTimeout):
		h.t.Fatalf("no executor frame within %s", waitTimeout)
	}
	return nil
}

// nextErr returns the error that ends the executor's frame stream.
func (h *harness) nextErr() error {
	h.t.Helper()
	select {
	case r := <-h.frames:
		if r.err == nil {
			h.t.Fatalf("expected the end of the frame stream, got %v", r.frame)
		}
		return r.err
	case <-time.After(waitTimeout):
		h.t.Fatalf("the frame stream did not end within %s", waitTimeout)
	}
	return nil
}

// noFrame asserts that nothing arrives for d.
func (h *harness) noFrame(d time.Duration) {
	h.t.Helper()
	select {
	case r := <-h.frames:
		h.t.Fatalf("expected no frame for %s, got %v (err %v)", d, r.frame, r.err)
	case <-time.After(d):
	}
}

func (h *harness) hello() *pb.Hello {
	h.t.Helper()
	f := h.next()
	if f.GetHello() == nil {
		h.t.Fatalf("first frame is not a hello: %v", f)
	}
	return f.GetHello()
}

func (h *harness) event(jobID string, seq uint64, kind pb.EventKind) *pb.ProgressEvent {
	h.t.Helper()
	f := h.next()
	ev := f.GetEvent()
	if ev == nil {
		h.t.Fatalf("want %s event seq %d, got %v", kind, seq, f)
	}
	if ev.GetJobId() != jobID || ev.GetSequence() != seq || ev.GetKind() != kind {
		h.t.Fatalf("want %s event for job %q seq %d, got %v", kind, jobID, seq, ev)
	}
	return ev
}

// started consumes the ACCEPTED and RUNNING events every executed job begins with.
func (h *harness) started(jobID string) {
	h.t.Helper()
	h.event(jobID, 1, pb.EventKind_EVENT_KIND_ACCEPTED)
	h.event(jobID, 2, pb.EventKind_EVENT_KIND_RUNNING)
}

func (h *harness) result(jobID string, seq uint64) *pb.JobResult {
	h.t.Helper()
	f := h.next()
	r := f.GetResult()
	if r == nil || r.GetJobId() != jobID || r.GetSequence() != seq {
		h.t.Fatalf("want result for job %q seq %d, got %v", jobID, seq, f)
	}
	return r
}

func (h *harness) jobError(jobID string, seq uint64, code string) *pb.JobError {
	h.t.Helper()
	f := h.next()
	e := f.GetError()
	if e == nil || e.GetJobId() != jobID || e.GetSequence() != seq || e.GetCode() != code {
		h.t.Fatalf("want error %s for job %q seq %d, got %v", code, jobID, seq, f)
	}
	return e
}

// wait returns Serve's error.
func (h *harness) wait() error {
	h.t.Helper()
	select {
	case err := <-h.served:
		h.serveErr = &err
		return err
	case <-time.After(waitTimeout):
		h.t.Fatalf("Serve did not return within %s", waitTimeout)
	}
	return nil
}

// waitOpen asserts that Serve is still running after d.
func (h *harness) stillServing(d time.Duration) {
	h.t.Helper()
	select {
	case err := <-h.served:
		h.serveErr = &err
		h.t.Fatalf("Serve returned early: %v", err)
	case <-time.After(d):
	}
}

func job(id, kind string, input string) *pb.Job {
	return &pb.Job{JobId: id, Kind: kind, ExecutorKind: "go", Attempt: 1, Input: []byte(input)}
}

func protoEqual(t *testing.T, what string, got, want proto.Message) {
	t.Helper()
	if !proto.Equal(got, want) {
		t.Fatalf("%s:\n got %v\nwant %v", what, got, want)
	}
}

func isErr(t *testing.T, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("error %v: want one matching %v", err, target)
	}
}
