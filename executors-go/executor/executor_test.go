package executor_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
	"github.com/durable-runtime/durable/executors-go/internal/rawframe"
)

func echoHandler(_ context.Context, j *executor.Job) (*executor.Result, error) {
	return &executor.Result{Output: j.Input}, nil
}

// blockHandler waits for cancellation and reports the cause it saw.
func blockHandler(started chan<- struct{}, cause chan<- error) executor.HandlerFunc {
	return func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		close(started)
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return nil, ctx.Err()
	}
}

func TestHelloContents(t *testing.T) {
	ex := newExecutor(executor.Options{ExecutorKind: "go", Labels: map[string]string{"gpu": "a100", "region": "eu"}})
	ex.Handle("z.last", echoHandler)
	ex.Handle("a.first", echoHandler)
	ex.Handle("m.middle", echoHandler)
	h := executortest.Start(t, ex)

	protoEqual(t, "hello", h.Hello(), &pb.Hello{
		ProtocolVersion:   pb.ProtocolVersion_PROTOCOL_VERSION_1,
		ExecutorKind:      "go",
		Kinds:             []string{"a.first", "m.middle", "z.last"},
		Labels:            map[string]string{"gpu": "a100", "region": "eu"},
		SdkName:           "durable-executor-go",
		SdkVersion:        executor.Version(),
		MaxJobsPerProcess: -1,
		Pid:               uint32(os.Getpid()),
		ProtocolVersions:  []string{"1.0", "1.1"},
		Features:          []string{"frame_limits"},
		MaxFrameBytes:     executor.DefaultMaxFrameBytes,
	})
}

// Protocol 1.1: a job's frames are held to the supervisor's limit stated in
// the job (lower than the SDK's own cap): a result over it becomes
// RESULT_TOO_LARGE, not an oversized frame; the same result fits a job from a
// 1.0 supervisor (no limit stated: the SDK's own cap). The Hello announces
// the SDK's own cap.
func TestTheSupervisorsFrameLimitIsRespected(t *testing.T) {
	ex := newExecutor(executor.Options{MaxFrameBytes: 64 << 10})
	var seen *executor.Job
	ex.Handle("big", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		seen = j
		return executor.NewResult(strings.Repeat("x", 5000))
	})
	ex.Handle("chatty", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		if err := j.ProgressWithCheckpoint("big", executor.NoFraction, []byte(strings.Repeat("c", 5000))); !errors.Is(err, executor.ErrFrameTooLarge) {
			return nil, fmt.Errorf("an event over the supervisor's limit: %v, want ErrFrameTooLarge", err)
		}
		return executor.NewResult("small")
	})
	h := executortest.Start(t, ex)
	if got := h.Hello().GetMaxFrameBytes(); got != 64<<10 {
		t.Fatalf("hello max_frame_bytes = %d, want %d", got, 64<<10)
	}

	limited := job("j1", "big", "")
	limited.NegotiatedVersion = "1.1"
	limited.NegotiatedFeatures = []string{"frame_limits"}
	limited.MaxFrameBytes = 4096
	h.SendJob(limited)
	h.Started("j1")
	e := h.JobError("j1", 3, executor.CodeResultTooLarge)
	if e.GetRetryable() || !strings.Contains(e.GetMessage(), "4096") {
		t.Fatalf("RESULT_TOO_LARGE = %v, want non-retryable naming the 4096-byte limit", e)
	}
	if seen.ProtocolVersion != "1.1" || !reflect.DeepEqual(seen.Features, []string{"frame_limits"}) {
		t.Fatalf("job protocol = %q %v", seen.ProtocolVersion, seen.Features)
	}

	h.SendJob(job("j2", "big", ""))
	h.Started("j2")
	if r := h.Result("j2", 3); len(r.GetOutput()) != 5002 {
		t.Fatalf("result of %d bytes, want the 5002-byte output", len(r.GetOutput()))
	}
	if seen.ProtocolVersion != "" {
		t.Fatalf("a job without a negotiated version: ProtocolVersion %q, want empty (1.0)", seen.ProtocolVersion)
	}

	chatty := job("j3", "chatty", "")
	chatty.MaxFrameBytes = 4096
	h.SendJob(chatty)
	h.Started("j3")
	if r := h.Result("j3", 3); string(r.GetOutput()) != `"small"` {
		t.Fatalf("chatty result = %q", r.GetOutput())
	}
}

func TestHelloOverrides(t *testing.T) {
	ex := newExecutor(executor.Options{ExecutorKind: "py-ish", SDKName: "custom", SDKVersion: "9.9", MaxJobsPerProcess: 3})
	h := executortest.Start(t, ex)
	got := h.Hello()
	if got.GetSdkName() != "custom" || got.GetSdkVersion() != "9.9" || got.GetMaxJobsPerProcess() != 3 || len(got.GetKinds()) != 0 {
		t.Fatalf("hello = %v", got)
	}
}

func TestEchoRoundTrip(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("demo.echo", echoHandler)
	h := executortest.Start(t, ex)
	h.Hello()

	input := `{"a":1,"b":[true,null,"x"]}`
	h.SendJob(job("j1", "demo.echo", input))
	h.Started("j1")
	r := h.Result("j1", 3)
	if string(r.GetOutput()) != input || len(r.GetArtifacts()) != 0 {
		t.Fatalf("result = %v, want output %s", r, input)
	}

	// Persistent: the same stream serves another job, sequences restart at 1.
	h.SendJob(job("j2", "demo.echo", `"again"`))
	h.Started("j2")
	if r := h.Result("j2", 3); string(r.GetOutput()) != `"again"` {
		t.Fatalf("second result = %v", r)
	}
	h.CloseStdin()
	if err := h.Wait(); err != nil {
		t.Fatalf("Serve after clean EOF: %v", err)
	}
}

func TestJobFieldsReachHandler(t *testing.T) {
	got := make(chan *executor.Job, 1)
	ex := newExecutor(executor.Options{})
	ex.Handle("k", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		got <- j
		return nil, nil
	})
	h := executortest.Start(t, ex)
	h.Hello()
	pj := &pb.Job{
		JobId: "j", WorkflowRunId: "wr", StepRunId: "sr", IdempotencyKey: "idem", ExecutorKind: "go", Kind: "k",
		Attempt: 4, DeadlineUnixMs: 1_700_000_000_123, AttemptDeadlineUnixMs: 1_700_000_000_456, HeartbeatTimeoutMs: 2500,
		Input: []byte(`{"x":1}`),
		InputArtifacts: []*pb.ArtifactRef{
			{Id: "a1", Name: "n1", Sha256: "00", Size: 3, MediaType: "text/plain", Path: "/abs/1", StepName: "s1"},
			{Id: "a2", Name: "n2", Sha256: "11", Size: 4, MediaType: "image/png", Path: "/abs/2", StepName: "s2"},
		},
		Checkpoint: []byte("cp"), OutputDir: "/out",
		Secrets: map[string]string{"TOKEN": "t0ken"}, Labels: map[string]string{"gpu": "yes"},
	}
	h.SendJob(pj)
	h.Started("j")
	h.Result("j", 3)
	j := <-got
	want := &executor.Job{
		ID: "j", WorkflowRunID: "wr", StepRunID: "sr", IdempotencyKey: "idem", ExecutorKind: "go", Kind: "k",
		Attempt: 4, Deadline: time.UnixMilli(1_700_000_000_123), AttemptDeadline: time.UnixMilli(1_700_000_000_456),
		HeartbeatTimeout: 2500 * time.Millisecond, Input: []byte(`{"x":1}`),
		InputArtifacts: []executor.ArtifactRef{
			{ID: "a1", Name: "n1", SHA256: "00", Size: 3, MediaType: "text/plain", Path: "/abs/1", StepName: "s1"},
			{ID: "a2", Name: "n2", SHA256: "11", Size: 4, MediaType: "image/png", Path: "/abs/2", StepName: "s2"},
		},
		PreviousCheckpoint: []byte("cp"), HasPreviousCheckpoint: true, OutputDir: "/out",
		Secrets: map[string]string{"TOKEN": "t0ken"}, Labels: map[string]string{"gpu": "yes"},
	}
	if !exportedEqual(*j, *want) {
		t.Fatalf("job:\n got %+v\nwant %+v", *j, *want)
	}
	var in struct{ X int }
	if err := j.DecodeInput(&in); err != nil || in.X != 1 {
		t.Fatalf("DecodeInput = %v, %+v", err, in)
	}
}

func TestUnknownKindIsRefusedBeforeAccepted(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("demo.echo", echoHandler)
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "demo.nope", `{}`))
	e := h.JobError("j1", 1, executor.CodeUnsupportedKind)
	if e.GetRetryable() || !strings.Contains(e.GetMessage(), `"demo.nope"`) || !strings.Contains(e.GetMessage(), "demo.echo") {
		t.Fatalf("refusal = %v", e)
	}
	// the details say the same, as the Python SDK's do
	if string(e.GetDetails()) != `{"handled_kinds":["demo.echo"],"kind":"demo.nope"}` {
		t.Fatalf("refusal details = %s", e.GetDetails())
	}
	// Still serving.
	h.SendJob(job("j2", "demo.echo", `1`))
	h.Started("j2")
	h.Result("j2", 3)
}

func TestCancelMidHandlerYieldsCancelledQuickly(t *testing.T) {
	started, cause := make(chan struct{}), make(chan error, 1)
	ex := newExecutor(executor.Options{})
	ex.Handle("block", blockHandler(started, cause))
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "block", ""))
	h.Started("j1")
	waitClosed(t, started, "handler start")

	// A cancel for another job is ignored.
	h.SendCancel(&pb.Cancel{JobId: "other", Reason: pb.CancelReason_CANCEL_REASON_REQUESTED})
	h.NoFrame(50 * time.Millisecond)

	sent := time.Now()
	h.SendCancel(&pb.Cancel{JobId: "j1", Reason: pb.CancelReason_CANCEL_REASON_LEASE_LOST, GraceMs: 1500, Message: "lease gone"})
	e := h.JobError("j1", 3, executor.CodeCancelled)
	if d := time.Since(sent); d > 100*time.Millisecond {
		t.Fatalf("CANCELLED took %s, want < 100ms", d)
	}
	if e.GetRetryable() || string(e.GetDetails()) != `{"reason":"LEASE_LOST"}` || !strings.Contains(e.GetMessage(), "lease gone") {
		t.Fatalf("cancelled error = %v", e)
	}
	var c *executor.Cancellation
	if err := <-cause; !errors.As(err, &c) || c.Reason != "LEASE_LOST" || c.Message != "lease gone" || c.Grace != 1500*time.Millisecond {
		t.Fatalf("context cause = %#v", err)
	}
}

// The terminal reflects what the handler did: a handler that ignores the cancel
// and finishes sends its result (the supervisor keeps it within the grace).
func TestResultReturnedAfterCancelIsSent(t *testing.T) {
	cause := make(chan error, 1)
	ex := newExecutor(executor.Options{})
	ex.Handle("stubborn", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		<-ctx.Done()
		cause <- context.Cause(ctx)
		return executor.NewResult(map[string]bool{"finished_after_cancel": true})
	})
	ex.Handle("nil-result", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		<-ctx.Done()
		return nil, nil
	})
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "stubborn", ""))
	h.Started("j1")
	h.SendCancel(&pb.Cancel{JobId: "j1", Reason: pb.CancelReason_CANCEL_REASON_REQUESTED, GraceMs: 500})
	if r := h.Result("j1", 3); string(r.GetOutput()) != `{"finished_after_cancel":true}` {
		t.Fatalf("result = %v", r)
	}
	var c *executor.Cancellation
	if err := <-cause; !errors.As(err, &c) || c.Reason != "REQUESTED" {
		t.Fatalf("context cause = %#v", err)
	}

	// (nil, nil) is a result too: output null.
	h.SendJob(job("j2", "nil-result", ""))
	h.Started("j2")
	h.SendCancel(&pb.Cancel{JobId: "j2", Reason: pb.CancelReason_CANCEL_REASON_REQUESTED})
	if r := h.Result("j2", 3); string(r.GetOutput()) != "null" {
		t.Fatalf("result = %v", r)
	}

	// stdin closing mid-job cancels the same way; a result still goes out.
	h.SendJob(job("j3", "stubborn", ""))
	h.Started("j3")
	h.CloseStdin()
	if r := h.Result("j3", 3); string(r.GetOutput()) != `{"finished_after_cancel":true}` {
		t.Fatalf("result = %v", r)
	}
	if err := <-cause; !errors.As(err, &c) || c.Reason != executor.ReasonStdinClosed {
		t.Fatalf("context cause = %#v", err)
	}
	if err := h.Wait(); err != nil {
		t.Fatalf("Serve = %v", err)
	}
}

// A handler that stops after a cancel ends the job CANCELLED: ctx.Err(), an
// error wrapping it, the cause, and also any other error or a panic (after a
// cancel a failure is taken as caused by it; the supervisor confirms the cancel
// on any error anyway).
func TestErrorAfterCancelIsCancelled(t *testing.T) {
	cases := []struct {
		name    string
		stop    func(ctx context.Context) (*executor.Result, error)
		message string // in the CANCELLED message, besides the cancellation
	}{
		{"ctx.Err", func(ctx context.Context) (*executor.Result, error) { return nil, ctx.Err() }, ""},
		{"wrapped", func(ctx context.Context) (*executor.Result, error) {
			return nil, fmt.Errorf("fetching page 3: %w", ctx.Err())
		}, ""},
		{"cause", func(ctx context.Context) (*executor.Result, error) { return nil, context.Cause(ctx) }, ""},
		{"result and ctx.Err", func(ctx context.Context) (*executor.Result, error) {
			r, _ := executor.NewResult("half done")
			return r, ctx.Err()
		}, ""},
		{"other error", func(context.Context) (*executor.Result, error) {
			return nil, &executor.Error{Code: "OTHER", Message: "cleanup failed"}
		}, "the handler returned: OTHER: cleanup failed"},
		{"plain error", func(context.Context) (*executor.Result, error) {
			return nil, errors.New("signal: killed")
		}, "the handler returned: signal: killed"},
		{"panic", func(context.Context) (*executor.Result, error) { panic("after cancel") }, "the handler then panicked: after cancel"},
		{"goexit", func(context.Context) (*executor.Result, error) { runtime.Goexit(); return nil, nil }, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ex := newExecutor(executor.Options{})
			ex.Handle("k", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
				<-ctx.Done()
				return tc.stop(ctx)
			})
			h := executortest.Start(t, ex)
			h.Hello()
			h.SendJob(job("j", "k", ""))
			h.Started("j")
			h.SendCancel(&pb.Cancel{JobId: "j", Reason: pb.CancelReason_CANCEL_REASON_REQUESTED, Message: "operator asked"})
			e := h.JobError("j", 3, executor.CodeCancelled)
			var details map[string]string
			if err := json.Unmarshal(e.GetDetails(), &details); err != nil {
				t.Fatalf("details %q: %v", e.GetDetails(), err)
			}
			if e.GetRetryable() || details["reason"] != "REQUESTED" ||
				!strings.Contains(e.GetMessage(), "operator asked") || !strings.Contains(e.GetMessage(), tc.message) {
				t.Fatalf("cancelled error = %v", e)
			}
			if tc.message == "" && (strings.Contains(e.GetMessage(), "the handler") || len(details) != 1) {
				t.Fatalf("the message repeats the cancellation: %q, details %v", e.GetMessage(), details)
			}
			// the handler's own error, for the supervisor to keep (PROTOCOL.md)
			if h := details["handler_error"]; tc.message != "" && (h == "" || !strings.Contains(e.GetMessage(), strings.TrimPrefix(h, "panic: "))) {
				t.Fatalf("details.handler_error = %q, message %q", h, e.GetMessage())
			}
		})
	}
}

func TestPanicBecomesHandlerPanicAndServingContinues(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("boom", func(context.Context, *executor.Job) (*executor.Result, error) { panic("kaboom") })
	ex.Handle("exit", func(context.Context, *executor.Job) (*executor.Result, error) { runtime.Goexit(); return nil, nil })
	ex.Handle("demo.echo", echoHandler)
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "boom", ""))
	h.Started("j1")
	e := h.JobError("j1", 3, executor.CodeHandlerPanic)
	if !e.GetRetryable() || !strings.Contains(e.GetMessage(), "kaboom") {
		t.Fatalf("panic error = %v", e)
	}
	h.SendJob(job("j2", "exit", ""))
	h.Started("j2")
	if e := h.JobError("j2", 3, executor.CodeHandlerPanic); !strings.Contains(e.GetMessage(), "Goexit") {
		t.Fatalf("Goexit error = %v", e)
	}
	h.SendJob(job("j3", "demo.echo", `3`))
	h.Started("j3")
	h.Result("j3", 3)
}

func TestErrorMapping(t *testing.T) {
	typed := &executor.Error{Code: "UPSTREAM_DOWN", Message: "503 from api",
		Details: map[string]any{"status": 503, "host": "api"}, NextRetryDelay: 1500*time.Millisecond + 1}
	ms := func(v uint64) *uint64 { return &v }
	cases := []struct {
		name string
		err  error
		want *pb.JobError
	}{
		{"plain", errors.New("disk full"), &pb.JobError{Code: executor.CodeHandlerError, Message: "disk full", Retryable: true}},
		{"typed", typed, &pb.JobError{Code: "UPSTREAM_DOWN", Message: "503 from api", Retryable: true,
			Details: []byte(`{"host":"api","status":503}`), NextRetryDelayMs: ms(1501)}},
		{"wrapped", fmt.Errorf("calling api: %w", &executor.Error{Code: "UPSTREAM_DOWN", Message: "503"}),
			&pb.JobError{Code: "UPSTREAM_DOWN", Message: "calling api: UPSTREAM_DOWN: 503", Retryable: true}},
		{"non-retryable", &executor.Error{Code: "NO_SUCH_USER", Message: "user 42", NonRetryable: true},
			&pb.JobError{Code: "NO_SUCH_USER", Message: "user 42"}},
		{"empty code", &executor.Error{Message: "oops"}, &pb.JobError{Code: executor.CodeHandlerError, Message: "oops", Retryable: true}},
		{"errorf retryable", executor.Errorf("QUOTA", true, "quota %d exceeded", 7), &pb.JobError{Code: "QUOTA", Message: "quota 7 exceeded", Retryable: true}},
		{"errorf", executor.Errorf("QUOTA", false, "quota %d exceeded", 7), &pb.JobError{Code: "QUOTA", Message: "quota 7 exceeded"}},
		// a code no step's non_retryable_codes could name (they are
		// UPPER_SNAKE_CASE): HANDLER_ERROR naming it, as the Python SDK
		{"lower-case code", &executor.Error{Code: "no_such_user", Message: "user 42", NonRetryable: true},
			&pb.JobError{Code: executor.CodeHandlerError, Message: `error code must be non-empty UPPER_SNAKE_CASE, got "no_such_user": user 42`}},
		{"code with a space", &executor.Error{Code: "NO SUCH", Message: "x"},
			&pb.JobError{Code: executor.CodeHandlerError, Message: `error code must be non-empty UPPER_SNAKE_CASE, got "NO SUCH": x`, Retryable: true}},
	}
	ex := newExecutor(executor.Options{})
	for _, c := range cases {
		ex.Handle(c.name, func(context.Context, *executor.Job) (*executor.Result, error) { return nil, c.err })
	}
	ex.Handle("decode", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		var v struct{ N int }
		return nil, j.DecodeInput(&v)
	})
	h := executortest.Start(t, ex)
	h.Hello()
	for i, c := range cases {
		id := fmt.Sprint("j", i)
		h.SendJob(job(id, c.name, ""))
		h.Started(id)
		got := h.JobError(id, 3, c.want.GetCode())
		c.want.JobId, c.want.Sequence = id, 3
		protoEqual(t, c.name, got, c.want)
	}
	h.SendJob(job("bad", "decode", `{"N":"not a number"}`))
	h.Started("bad")
	if e := h.JobError("bad", 3, executor.CodeBadInput); e.GetRetryable() {
		t.Fatalf("BAD_INPUT must not be retryable: %v", e)
	}
}

func TestSequencesStrictlyIncrease(t *testing.T) {
	const workers, each = 8, 25
	ex := newExecutor(executor.Options{})
	ex.Handle("chatty", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		var wg sync.WaitGroup
		errs := make(chan error, workers*each)
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for i := 0; i < each; i++ {
					if i%2 == 0 {
						errs <- j.Progress(fmt.Sprint(w, i), float64(i)/each)
					} else {
						errs <- j.Heartbeat()
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				return nil, err
			}
		}
		return nil, nil
	})
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j", "chatty", ""))
	var last uint64
	for n := 0; ; n++ {
		f := h.Next()
		var seq uint64
		switch {
		case f.GetEvent() != nil:
			seq = f.GetEvent().GetSequence()
		case f.GetResult() != nil:
			seq = f.GetResult().GetSequence()
			if want := uint64(2 + workers*each + 1); seq != want || n+1 != int(want) {
				t.Fatalf("terminal sequence %d after %d frames, want %d", seq, n+1, want)
			}
			return
		default:
			t.Fatalf("unexpected frame %v", f)
		}
		if seq != last+1 {
			t.Fatalf("sequence %d follows %d", seq, last)
		}
		last = seq
	}
}

func TestCheckpoints(t *testing.T) {
	type seen struct {
		cp  []byte
		has bool
	}
	got := make(chan seen, 3)
	ex := newExecutor(executor.Options{})
	ex.Handle("cp", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		got <- seen{j.PreviousCheckpoint, j.HasPreviousCheckpoint}
		if err := j.Checkpoint([]byte("hb-cp")); err != nil {
			return nil, err
		}
		if err := j.ProgressWithCheckpoint("half", 0.5, []byte("pr-cp")); err != nil {
			return nil, err
		}
		if err := j.Progress("unknown fraction", executor.NoFraction); err != nil {
			return nil, err
		}
		for _, f := range []float64{1.5, -0.25, math.Inf(1), math.Inf(-1), math.NaN()} { // clamped; ±Inf, NaN: none
			if err := j.Progress("out of range", f); err != nil {
				return nil, err
			}
		}
		return nil, j.Heartbeat()
	})
	h := executortest.Start(t, ex)
	h.Hello()

	for _, c := range []struct {
		id string
		cp []byte
	}{{"with", []byte("resume-here")}, {"empty", []byte{}}, {"absent", nil}} {
		pj := job(c.id, "cp", "")
		pj.Checkpoint = c.cp
		h.SendJob(pj)
		h.Started(c.id)
		ev := h.Event(c.id, 3, pb.EventKind_EVENT_KIND_HEARTBEAT)
		if ev.Checkpoint == nil || string(ev.Checkpoint) != "hb-cp" || ev.Fraction != nil {
			t.Fatalf("checkpoint heartbeat = %v", ev)
		}
		ev = h.Event(c.id, 4, pb.EventKind_EVENT_KIND_PROGRESS)
		if string(ev.Checkpoint) != "pr-cp" || ev.Fraction == nil || *ev.Fraction != 0.5 || ev.Message != "half" {
			t.Fatalf("progress with checkpoint = %v", ev)
		}
		if ev = h.Event(c.id, 5, pb.EventKind_EVENT_KIND_PROGRESS); ev.Fraction != nil || ev.Checkpoint != nil {
			t.Fatalf("progress without fraction = %v", ev)
		}
		for i, want := range []float64{1, 0, -1, -1, -1} {
			ev = h.Event(c.id, uint64(6+i), pb.EventKind_EVENT_KIND_PROGRESS)
			if (want < 0) != (ev.Fraction == nil) || (want >= 0 && *ev.Fraction != want) {
				t.Fatalf("out-of-range fraction %d: event %v, want fraction %v (-1: none)", i, ev, want)
			}
		}
		if ev = h.Event(c.id, 11, pb.EventKind_EVENT_KIND_HEARTBEAT); ev.Checkpoint != nil || ev.AtUnixMs == 0 {
			t.Fatalf("heartbeat = %v", ev)
		}
		h.Result(c.id, 12)
		s := <-got
		if s.has != (c.cp != nil) || string(s.cp) != string(c.cp) || (s.has && s.cp == nil) {
			t.Fatalf("job %s: handler saw checkpoint %q (present %v), want %q (present %v)", c.id, s.cp, s.has, c.cp, c.cp != nil)
		}
	}
}

func TestCleanEOFWhenIdleReturnsNil(t *testing.T) {
	h := executortest.Start(t, newExecutor(executor.Options{}))
	h.Hello()
	h.StillServing(20 * time.Millisecond)
	h.CloseStdin()
	if err := h.Wait(); err != nil {
		t.Fatalf("Serve = %v, want nil", err)
	}
	if err := h.EndOfStream(); err.Error() != "EOF" {
		t.Fatalf("frame stream ended with %v, want a clean EOF", err)
	}
}

func TestTruncatedFrameIsAnError(t *testing.T) {
	h := executortest.Start(t, newExecutor(executor.Options{}))
	h.Hello()
	h.SendRaw([]byte{10, 1, 2, 3}) // announces 10 bytes, sends 3
	h.CloseStdin()
	err := h.Wait()
	isErr(t, err, executor.ErrTruncatedFrame)
	if !strings.Contains(err.Error(), "3 of 10") {
		t.Fatalf("error %q does not say how much was read", err)
	}
}

func TestMalformedFrameIsAnError(t *testing.T) {
	h := executortest.Start(t, newExecutor(executor.Options{}))
	h.Hello()
	h.SendRaw([]byte{3, 0xff, 0xff, 0xff}) // a 3-byte body that is no SupervisorFrame
	isErr(t, h.Wait(), executor.ErrMalformedFrame)
}

func TestOversizeFrameRejectedByServe(t *testing.T) {
	h := executortest.Start(t, newExecutor(executor.Options{MaxFrameBytes: 1024}))
	h.Hello()
	h.SendRaw([]byte{0x81, 0x08}) // 1025
	err := h.Wait()
	var tl *executor.FrameTooLargeError
	if !errors.As(err, &tl) || tl.Size != 1025 || tl.MaxSize != 1024 {
		t.Fatalf("Serve = %v, want a FrameTooLargeError for 1025 > 1024", err)
	}
}

func TestBrokenFrameMidJobCancelsTheJob(t *testing.T) {
	started, cause := make(chan struct{}), make(chan error, 1)
	ex := newExecutor(executor.Options{})
	ex.Handle("block", blockHandler(started, cause))
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j", "block", ""))
	h.Started("j")
	waitClosed(t, started, "handler start")
	h.SendRaw([]byte{0x05, 1})
	h.CloseStdin()
	h.JobError("j", 3, executor.CodeCancelled)
	isErr(t, h.Wait(), executor.ErrTruncatedFrame)
	var c *executor.Cancellation
	if err := <-cause; !errors.As(err, &c) || c.Reason != executor.ReasonProtocolError {
		t.Fatalf("cause = %v", err)
	}
}

func TestEOFMidJobCancelsAndStillSendsTerminal(t *testing.T) {
	started, cause := make(chan struct{}), make(chan error, 1)
	ex := newExecutor(executor.Options{})
	ex.Handle("block", blockHandler(started, cause))
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j", "block", ""))
	h.Started("j")
	waitClosed(t, started, "handler start")
	h.CloseStdin()
	if e := h.JobError("j", 3, executor.CodeCancelled); string(e.GetDetails()) != `{"reason":"STDIN_CLOSED"}` {
		t.Fatalf("terminal = %v", e)
	}
	if err := h.Wait(); err != nil {
		t.Fatalf("Serve = %v", err)
	}
	var c *executor.Cancellation
	if err := <-cause; !errors.As(err, &c) || c.Reason != executor.ReasonStdinClosed {
		t.Fatalf("cause = %v", err)
	}
}

func TestEOFMidJobGivesUpAfterStopGrace(t *testing.T) {
	ex := newExecutor(executor.Options{StopGrace: 50 * time.Millisecond})
	release := make(chan struct{})
	defer close(release)
	ex.Handle("deaf", func(context.Context, *executor.Job) (*executor.Result, error) { <-release; return nil, nil })
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j", "deaf", ""))
	h.Started("j")
	h.CloseStdin()
	err := h.Wait()
	if err == nil || !strings.Contains(err.Error(), "did not return within 50ms") {
		t.Fatalf("Serve = %v, want a stop-grace error", err)
	}
}

func TestShutdown(t *testing.T) {
	t.Run("idle", func(t *testing.T) {
		h := executortest.Start(t, newExecutor(executor.Options{}))
		h.Hello()
		h.Send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Shutdown{Shutdown: &pb.Shutdown{Reason: "done"}}})
		if err := h.Wait(); err != nil {
			t.Fatalf("Serve = %v", err)
		}
	})
	t.Run("mid job lets it finish", func(t *testing.T) {
		release := make(chan struct{})
		ex := newExecutor(executor.Options{})
		ex.Handle("slow", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
			select {
			case <-release:
				return executor.NewResult("finished")
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		})
		h := executortest.Start(t, ex)
		h.Hello()
		h.SendJob(job("j", "slow", ""))
		h.Started("j")
		h.Send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Shutdown{Shutdown: &pb.Shutdown{}}})
		h.CloseStdin() // EOF after Shutdown does not cancel the job
		h.StillServing(30 * time.Millisecond)
		close(release)
		if r := h.Result("j", 3); string(r.GetOutput()) != `"finished"` {
			t.Fatalf("result = %v", r)
		}
		if err := h.Wait(); err != nil {
			t.Fatalf("Serve = %v", err)
		}
	})
}

// One meaning in both SDKs: 0 (the default) or negative is unlimited, which
// the hello says as -1 (a 0 on the wire would mean one job).
func TestMaxJobsPerProcessInHello(t *testing.T) {
	for n, want := range map[int]int32{0: -1, -1: -1, -7: -1, 1: 1, 5: 5, math.MaxInt: math.MaxInt32} {
		if got := executortest.Start(t, newExecutor(executor.Options{MaxJobsPerProcess: n})).Hello().GetMaxJobsPerProcess(); got != want {
			t.Errorf("MaxJobsPerProcess %d: hello says %d, want %d", n, got, want)
		}
	}
}

func TestMaxJobsPerProcess(t *testing.T) {
	ex := newExecutor(executor.Options{MaxJobsPerProcess: 1})
	ex.Handle("demo.echo", echoHandler)
	h := executortest.Start(t, ex)
	if got := h.Hello().GetMaxJobsPerProcess(); got != 1 {
		t.Fatalf("hello max_jobs_per_process = %d", got)
	}
	h.SendJob(job("j", "demo.echo", `1`))
	h.Started("j")
	h.Result("j", 3)
	if err := h.Wait(); err != nil { // without stdin closing
		t.Fatalf("Serve = %v", err)
	}
}

// A job refused for its kind counts toward MaxJobsPerProcess, as the
// supervisor and the Python SDK count it.
func TestARefusedJobCountsTowardMaxJobsPerProcess(t *testing.T) {
	ex := newExecutor(executor.Options{MaxJobsPerProcess: 2})
	ex.Handle("demo.echo", echoHandler)
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "no.such.kind", `1`))
	h.JobError("j1", 1, executor.CodeUnsupportedKind)
	h.SendJob(job("j2", "demo.echo", `1`))
	h.Started("j2")
	h.Result("j2", 3)
	if err := h.Wait(); err != nil { // two jobs answered: Serve returns
		t.Fatalf("Serve = %v", err)
	}
}

func TestNoFrameAfterTerminal(t *testing.T) {
	leaked := make(chan *executor.Job, 1)
	ex := newExecutor(executor.Options{})
	ex.Handle("leak", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		leaked <- j
		return nil, nil
	})
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j", "leak", ""))
	h.Started("j")
	h.Result("j", 3)
	j := <-leaked
	if err := j.Progress("late", 1); !errors.Is(err, executor.ErrJobFinished) {
		t.Fatalf("Progress after the terminal = %v, want ErrJobFinished", err)
	}
	if err := j.Heartbeat(); !errors.Is(err, executor.ErrJobFinished) {
		t.Fatalf("Heartbeat after the terminal = %v, want ErrJobFinished", err)
	}
	h.NoFrame(30 * time.Millisecond)
}

func TestResultValidation(t *testing.T) {
	ex := newExecutor(executor.Options{MaxFrameBytes: 4096})
	ex.Handle("not-json", func(context.Context, *executor.Job) (*executor.Result, error) {
		return &executor.Result{Output: []byte("{nope")}, nil
	})
	ex.Handle("nil", func(context.Context, *executor.Job) (*executor.Result, error) { return nil, nil })
	ex.Handle("huge", func(context.Context, *executor.Job) (*executor.Result, error) {
		return executor.NewResult(strings.Repeat("x", 10_000))
	})
	ex.Handle("escape", func(context.Context, *executor.Job) (*executor.Result, error) {
		return &executor.Result{Output: []byte(`1`), Artifacts: []executor.Artifact{{Name: "a", Path: "../etc/passwd"}}}, nil
	})
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "not-json", ""))
	h.Started("j1")
	if e := h.JobError("j1", 3, executor.CodeOutputInvalid); e.GetRetryable() {
		t.Fatalf("OUTPUT_INVALID retryable: %v", e)
	}
	h.SendJob(job("j2", "nil", ""))
	h.Started("j2")
	if r := h.Result("j2", 3); string(r.GetOutput()) != "null" {
		t.Fatalf("nil result output = %q, want null", r.GetOutput())
	}
	h.SendJob(job("j3", "huge", ""))
	h.Started("j3")
	if e := h.JobError("j3", 3, executor.CodeResultTooLarge); e.GetRetryable() || !strings.Contains(e.GetMessage(), "4096") {
		t.Fatalf("RESULT_TOO_LARGE = %v", e)
	}
	h.SendJob(job("j4", "escape", ""))
	h.Started("j4")
	h.JobError("j4", 3, "ARTIFACT_INVALID")
}

// The SDK redacts as the supervisor does: a value of 4+ bytes wherever it
// occurs (also JSON-escaped or percent-encoded), a shorter one only where it
// is a whole string (message, details value or key).
func TestSecretsAreRedactedFromMessages(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("leaky", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		tok, pin := j.Secrets["TOKEN"], j.Secrets["PIN"]
		for _, m := range []string{"using " + tok, pin, "pin " + pin + " of 42", `{"q":"` + strings.ReplaceAll(j.Secrets["QUOTED"], `"`, `\"`) + `"}`, "?k=a%2Fb%3Dc"} {
			if err := j.Progress(m, executor.NoFraction); err != nil {
				return nil, err
			}
		}
		return nil, &executor.Error{Code: "AUTH", Message: "token " + tok + " rejected",
			Details: map[string]any{"token": tok, "pin": pin, "near": pin + "1", pin: "as a key", "nested": []any{map[string]any{"t": "x" + tok}}}}
	})
	h := executortest.Start(t, ex)
	h.Hello()
	pj := job("j", "leaky", "")
	pj.Secrets = map[string]string{"TOKEN": "s3cr3t-value", "PIN": "42", "QUOTED": `say "hi"`, "SLASHED": "a/b=c", "EMPTY": ""}
	h.SendJob(pj)
	h.Started("j")
	for i, want := range []string{"using [REDACTED]", "[REDACTED]", "pin 42 of 42", `{"q":"[REDACTED]"}`, "?k=[REDACTED]"} {
		if ev := h.Event("j", uint64(3+i), pb.EventKind_EVENT_KIND_PROGRESS); ev.GetMessage() != want {
			t.Errorf("progress message %d = %q, want %q", i, ev.GetMessage(), want)
		}
	}
	e := h.JobError("j", 8, "AUTH")
	if e.GetMessage() != "token [REDACTED] rejected" ||
		string(e.GetDetails()) != `{"[REDACTED]":"as a key","near":"421","nested":[{"t":"x[REDACTED]"}],"pin":"[REDACTED]","token":"[REDACTED]"}` {
		t.Fatalf("error = %v", e)
	}
}

func TestSecondJobWhileBusyIsRefused(t *testing.T) {
	release := make(chan struct{})
	ex := newExecutor(executor.Options{})
	ex.Handle("slow", func(context.Context, *executor.Job) (*executor.Result, error) { <-release; return nil, nil })
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j1", "slow", ""))
	h.Started("j1")
	h.SendJob(job("j2", "slow", ""))
	h.JobError("j2", 1, executor.CodeExecutorBusy)
	close(release)
	h.Result("j1", 3)
}

// failingWriter accepts n writes, then fails.
type failingWriter struct {
	mu sync.Mutex
	n  int
}

func (w *failingWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.n == 0 {
		return 0, errors.New("broken pipe")
	}
	w.n--
	return len(b), nil
}

func TestBrokenOutput(t *testing.T) {
	t.Run("hello", func(t *testing.T) {
		err := newExecutor(executor.Options{}).Serve(strings.NewReader(""), &failingWriter{n: 0})
		if err == nil || !strings.Contains(err.Error(), "sending hello") {
			t.Fatalf("Serve = %v", err)
		}
	})
	t.Run("mid job", func(t *testing.T) {
		cause := make(chan error, 1)
		ex := newExecutor(executor.Options{})
		ex.Handle("talk", func(ctx context.Context, j *executor.Job) (*executor.Result, error) {
			err := j.Progress("x", executor.NoFraction)
			if err == nil {
				return nil, errors.New("progress on a broken stream succeeded")
			}
			<-ctx.Done() // the broken stream cancels the job
			cause <- context.Cause(ctx)
			return nil, err
		})
		in, inW := pipeWithJob(t, job("j", "talk", ""))
		defer inW.Close()
		err := ex.Serve(in, &failingWriter{n: 2}) // hello, ACCEPTED and RUNNING (one write)
		if err == nil || !strings.Contains(err.Error(), "broken pipe") {
			t.Fatalf("Serve = %v", err)
		}
		var c *executor.Cancellation
		if err := <-cause; !errors.As(err, &c) || c.Reason != executor.ReasonOutputBroken {
			t.Fatalf("cause = %v", err)
		}
	})
}

// pipeWithJob returns a reader that yields the job frame and then blocks until
// the writer is closed.
func pipeWithJob(t *testing.T, j *pb.Job) (*os.File, *os.File) {
	t.Helper()
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	b, err := executor.MarshalFrame(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: j}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(b); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r, w
}

func TestHandleMisuse(t *testing.T) {
	mustPanic := func(name string, f func()) {
		t.Helper()
		defer func() {
			if recover() == nil {
				t.Errorf("%s did not panic", name)
			}
		}()
		f()
	}
	ex := newExecutor(executor.Options{})
	ex.Handle("k", echoHandler)
	mustPanic("duplicate kind", func() { ex.Handle("k", echoHandler) })
	mustPanic("empty kind", func() { ex.Handle("", echoHandler) })
	mustPanic("nil handler", func() { ex.Handle("x", nil) })
	if got := ex.Kinds(); !slices.Equal(got, []string{"k"}) {
		t.Fatalf("Kinds = %v", got)
	}
	_ = ex.Serve(strings.NewReader(""), &failingWriter{n: 10})
	mustPanic("Handle after Serve", func() { ex.Handle("late", echoHandler) })
}

func TestErrorString(t *testing.T) {
	e := &executor.Error{Code: "X", Message: "m", Err: os.ErrNotExist}
	if e.Error() != "X: m" || !errors.Is(e, os.ErrNotExist) {
		t.Fatalf("Error() = %q, Is(ErrNotExist) = %v", e.Error(), errors.Is(e, os.ErrNotExist))
	}
	if (&executor.Error{}).Error() != executor.CodeHandlerError {
		t.Fatalf("empty Error() = %q", (&executor.Error{}).Error())
	}
	w := executor.Errorf("Y", true, "wrapping: %w", os.ErrClosed)
	if !errors.Is(w, os.ErrClosed) || w.Message != "wrapping: "+os.ErrClosed.Error() {
		t.Fatalf("Errorf = %#v", w)
	}
	if (&executor.Cancellation{Reason: "R", Message: "why"}).Error() != "job cancelled (R): why" {
		t.Fatal("Cancellation.Error format changed")
	}
}

func TestRawTerminalSuppressesTheSDKTerminal(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("raw", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		if err := rawframe.Of(j).SendFrame(&pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Event{Event: &pb.ProgressEvent{
			JobId: j.ID, Sequence: 9, Kind: pb.EventKind_EVENT_KIND_PROGRESS}}}); err != nil {
			return nil, err
		}
		if err := rawframe.Of(j).SendFrame(&pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Result{Result: &pb.JobResult{
			JobId: j.ID, Sequence: 10, Output: []byte(`"raw"`)}}}); err != nil {
			return nil, err
		}
		if err := j.Progress("late", executor.NoFraction); !errors.Is(err, executor.ErrJobFinished) {
			return nil, fmt.Errorf("Progress after a raw terminal = %v", err)
		}
		return nil, errors.New("ignored: the terminal already went out")
	})
	ex.Handle("demo.echo", echoHandler)
	h := executortest.Start(t, ex)
	h.Hello()
	h.SendJob(job("j", "raw", ""))
	h.Started("j")
	h.Event("j", 9, pb.EventKind_EVENT_KIND_PROGRESS)
	h.Result("j", 10)
	// The next job's frames follow directly: no SDK terminal for "j".
	h.SendJob(job("k", "demo.echo", `1`))
	h.Started("k")
	h.Result("k", 3)
}

// recordingWriter keeps each Write's bytes apart.
type recordingWriter struct {
	mu     sync.Mutex
	writes [][]byte
}

func (w *recordingWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.writes = append(w.writes, append([]byte(nil), b...))
	return len(b), nil
}

// The job's automatic ACCEPTED and RUNNING go out in one write: one system
// call, and one wake-up of the supervisor's reader, fewer per job.
func TestAcceptedAndRunningAreOneWrite(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("quick", func(ctx context.Context, j *executor.Job) (*executor.Result, error) {
		return executor.NewResult(map[string]int{"ok": 1})
	})
	in, inW := pipeWithJob(t, job("j", "quick", ""))
	w := &recordingWriter{}
	done := make(chan error, 1)
	go func() { done <- ex.Serve(in, w) }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		w.mu.Lock()
		n := len(w.writes)
		w.mu.Unlock()
		if n >= 3 || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	inW.Close()
	<-done
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.writes) != 3 {
		t.Fatalf("writes = %d, want 3 (hello; ACCEPTED and RUNNING; the result)", len(w.writes))
	}
	fr := executor.NewFrameReader(bytes.NewReader(w.writes[1]), 0)
	var kinds []pb.EventKind
	for {
		var f pb.ExecutorFrame
		if err := fr.Read(&f); err != nil {
			break
		}
		kinds = append(kinds, f.GetEvent().GetKind())
	}
	want := []pb.EventKind{pb.EventKind_EVENT_KIND_ACCEPTED, pb.EventKind_EVENT_KIND_RUNNING}
	if len(kinds) != 2 || kinds[0] != want[0] || kinds[1] != want[1] {
		t.Fatalf("second write holds %v, want %v", kinds, want)
	}
}
