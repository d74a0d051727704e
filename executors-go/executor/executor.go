package executor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
	"github.com/durable-runtime/durable/executors-go/internal/rawframe"
)

func init() {
	rawframe.Of = func(job any) rawframe.Writer {
		if j, ok := job.(*Job); ok && j.run != nil {
			return j.run
		}
		return notRunning{}
	}
}

type notRunning struct{}

func (notRunning) WriteRaw([]byte) error { return errors.New("executor: the job is not running") }
func (notRunning) SendFrame(f *pb.ExecutorFrame) error {
	return errors.New("executor: the job is not running")
}

// DefaultStopGrace is how long Serve waits, once stdin has ended (or carried a
// broken frame) in the middle of a job, for the cancelled handler to return.
const DefaultStopGrace = 10 * time.Second

// DefaultDeadlineSlack is how much earlier than the job's deadline the
// handler's context expires (see Options.DeadlineSlack).
const DefaultDeadlineSlack = time.Second

// HandlerFunc runs one job. ctx is cancelled when the supervisor cancels the job
// (context.Cause(ctx) is then a *Cancellation) or stdin ends mid-job, and
// carries the job's deadline (see Options.DeadlineSlack).
//
// Return a *Result on success, or an error: an *Error (possibly wrapped) picks
// the JobError's code (retryable unless NonRetryable); context.DeadlineExceeded
// (possibly wrapped), or any other error once ctx's deadline has passed,
// becomes HANDLER_TIMEOUT (retryable); any other error becomes HANDLER_ERROR
// (retryable).
//
// The terminal reflects what the handler did, also after a cancel: a handler
// that returns a result (nil error) once ctx is cancelled has finished its work,
// and that result is sent (the supervisor keeps it if it arrives within the
// cancel grace, so the finished work is not repeated). A handler that stops
// because of the cancel returns ctx.Err() (or an error wrapping it); once ctx
// is cancelled, any error, panic or runtime.Goexit is reported as CANCELLED
// (not retryable), the handler's own error kept in the message.
type HandlerFunc func(ctx context.Context, job *Job) (*Result, error)

// Options describe an executor in its Hello.
type Options struct {
	// ExecutorKind is matched exactly against a step's executor_kind; default "go".
	ExecutorKind string
	// Labels are the capabilities offered; a step's every label must be
	// offered with an equal value.
	Labels map[string]string
	// SDKName and SDKVersion default to SDKName and Version().
	SDKName    string
	SDKVersion string
	// MaxJobsPerProcess: N > 0 serves N jobs (a job refused for its kind
	// counts, as the supervisor counts it), then Serve returns (Hello says
	// N); 0 (the default) or negative serves jobs until stdin ends or a
	// Shutdown arrives (Hello says -1, unlimited). The Python SDK's
	// max_jobs_per_process means the same. (On the wire a Hello saying 0 means
	// one job; the SDKs never send 0.)
	MaxJobsPerProcess int
	// MaxFrameBytes caps frames in both directions; <= 0 means
	// DefaultMaxFrameBytes. Give at least 64 KiB (65536): a supervisor
	// refuses an executor whose Hello announces less (no job would fit), and
	// a worker does not start with it. The Hello announces it (the
	// supervisor sends no larger frame), and a job's frames are also held to
	// the supervisor's own limit (Job.max_frame_bytes, protocol 1.1): a
	// terminal over the smaller of the two is replaced by RESULT_TOO_LARGE
	// (not retryable).
	MaxFrameBytes int
	// StopGrace: see DefaultStopGrace (the default when <= 0).
	StopGrace time.Duration
	// DeadlineSlack: the handler's context expires this much before the job's
	// deadline (the earlier of Job.AttemptDeadline and Job.Deadline), so that a
	// handler that runs into it returns, and its HANDLER_TIMEOUT (retryable)
	// reaches the supervisor, before the supervisor ends the attempt itself.
	// At most a tenth of the time the job has left when it starts is taken.
	// <= 0 means DefaultDeadlineSlack.
	DeadlineSlack time.Duration
	// NoDeadline: the handler's context carries no deadline; the supervisor
	// alone enforces the job's deadlines, by sending Cancel (the attempt then
	// ends with its own ATTEMPT_TIMEOUT or DEADLINE_EXCEEDED).
	NoDeadline bool
	// Logger receives the SDK's diagnostics and is the base of Job.Logger;
	// default: text on stderr (slog.NewTextHandler(os.Stderr, nil)).
	Logger *slog.Logger
}

// Executor dispatches jobs to handlers by kind.
type Executor struct {
	opts Options
	log  *slog.Logger

	mu       sync.Mutex
	handlers map[string]HandlerFunc
	started  bool
}

// New returns an executor with no handlers.
func New(opts Options) *Executor {
	if opts.ExecutorKind == "" {
		opts.ExecutorKind = "go"
	}
	if opts.SDKName == "" {
		opts.SDKName = SDKName
	}
	if opts.SDKVersion == "" {
		opts.SDKVersion = Version()
	}
	if opts.MaxFrameBytes <= 0 {
		opts.MaxFrameBytes = DefaultMaxFrameBytes
	}
	if opts.StopGrace <= 0 {
		opts.StopGrace = DefaultStopGrace
	}
	if opts.DeadlineSlack <= 0 {
		opts.DeadlineSlack = DefaultDeadlineSlack
	}
	lg := opts.Logger
	if lg == nil {
		lg = slog.New(slog.NewTextHandler(os.Stderr, nil))
	}
	labels := make(map[string]string, len(opts.Labels))
	for k, v := range opts.Labels {
		labels[k] = v
	}
	opts.Labels = labels
	return &Executor{opts: opts, log: lg, handlers: map[string]HandlerFunc{}}
}

// Handle registers the handler for a job kind, e.g. "demo.echo". It panics on
// an empty kind, a nil handler, a kind registered twice, or a call after Serve
// or Run started.
func (e *Executor) Handle(kind string, h HandlerFunc) {
	e.mu.Lock()
	defer e.mu.Unlock()
	switch {
	case e.started:
		panic("executor: Handle called after Serve/Run started")
	case kind == "":
		panic("executor: Handle with an empty kind")
	case h == nil:
		panic("executor: Handle(" + kind + ") with a nil handler")
	case e.handlers[kind] != nil:
		panic("executor: kind " + kind + " registered twice")
	}
	e.handlers[kind] = h
}

// Kinds returns the registered kinds, sorted.
func (e *Executor) Kinds() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	kinds := make([]string, 0, len(e.handlers))
	for k := range e.handlers {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	return kinds
}

// Run serves the supervisor on the process's stdin and stdout and returns the
// exit code for os.Exit: 0 after a clean end (stdin closed or Shutdown, or the
// job quota served), 1 after a broken stream, 2 if the standard streams could
// not be set up.
//
// Before anything else it moves stdout to a private descriptor used only for
// frames and points fd 1 (and so os.Stdout, fmt.Println and child processes
// inheriting fd 1) at stderr; stdin likewise moves to a private descriptor and
// fd 0 reads /dev/null, so no child process can consume frames (ClaimStdio;
// when main already called it, Run serves on the streams it took).
func (e *Executor) Run() int {
	in, out, err := ClaimStdio()
	if err != nil {
		e.log.Error("cannot set up the frame streams", "err", err)
		return 2
	}
	if err := e.Serve(in, out); err != nil {
		e.log.Error("executor: serving ended on an error", "err", err)
		return 1
	}
	return 0
}

// Serve runs the protocol on in (SupervisorFrames) and out (ExecutorFrames):
// Hello first, then jobs one at a time. It returns nil when in ends between
// frames or a Shutdown arrives while idle (or after the running job ends), or
// when MaxJobsPerProcess jobs were served; it returns an error when in carries
// a broken frame or out cannot be written.
func (e *Executor) Serve(in io.Reader, out io.Writer) error {
	e.mu.Lock()
	e.started = true
	handlers := make(map[string]HandlerFunc, len(e.handlers))
	for k, h := range e.handlers {
		handlers[k] = h
	}
	e.mu.Unlock()
	s := &session{
		e:        e,
		handlers: handlers,
		w:        &frameWriter{w: out, max: e.opts.MaxFrameBytes},
	}
	return s.serve(in)
}

func (e *Executor) hello() *pb.Hello {
	maxJobs := int32(-1)
	if n := e.opts.MaxJobsPerProcess; n > 0 {
		maxJobs = int32(min(n, 1<<31-1))
	}
	return &pb.Hello{
		ProtocolVersion:   pb.ProtocolVersion_PROTOCOL_VERSION_1,
		ExecutorKind:      e.opts.ExecutorKind,
		Kinds:             e.Kinds(),
		Labels:            e.opts.Labels,
		SdkName:           e.opts.SDKName,
		SdkVersion:        e.opts.SDKVersion,
		MaxJobsPerProcess: maxJobs,
		Pid:               uint32(os.Getpid()),
		ProtocolVersions:  append([]string(nil), ProtocolVersions...),
		Features:          []string{FeatureFrameLimits},
		MaxFrameBytes:     uint64(e.opts.MaxFrameBytes),
	}
}

// session is one Serve call: one frame stream, jobs one after another.
type session struct {
	e        *Executor
	handlers map[string]HandlerFunc
	w        *frameWriter
}

type inbound struct {
	frame *pb.SupervisorFrame
	err   error
}

// readFrames keeps reading stdin, also while a handler runs, so that a Cancel is
// seen as soon as it arrives. It stops after the first error.
func readFrames(fr *FrameReader, out chan<- inbound, quit <-chan struct{}) {
	for {
		f := &pb.SupervisorFrame{}
		err := fr.Read(f)
		select {
		case out <- inbound{frame: f, err: err}:
		case <-quit:
			return
		}
		if err != nil {
			return
		}
	}
}

func (s *session) serve(in io.Reader) error {
	if err := s.w.write(&pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Hello{Hello: s.e.hello()}}); err != nil {
		return fmt.Errorf("executor: sending hello: %w", err)
	}
	frames := make(chan inbound)
	quit := make(chan struct{})
	defer close(quit)
	go readFrames(NewFrameReader(in, s.e.opts.MaxFrameBytes), frames, quit)

	var cur *jobRun
	served := 0
	shuttingDown := false
	// finish accounts for the job whose run has ended; stop reports that this
	// session is over (Shutdown received, or the job quota served).
	finish := func() (stop bool, err error) {
		cur = nil
		served++
		if err := s.w.broken(); err != nil {
			return true, fmt.Errorf("executor: %w", err)
		}
		n := s.e.opts.MaxJobsPerProcess
		return shuttingDown || (n > 0 && served >= n), nil
	}
	for {
		var curDone <-chan struct{}
		if cur != nil {
			curDone = cur.done
		}
		select {
		case <-curDone:
			if stop, err := finish(); stop {
				return err
			}

		case msg := <-frames:
			if msg.err != nil {
				return s.endOfInput(cur, msg.err, shuttingDown)
			}
			switch f := msg.frame.GetFrame().(type) {
			case *pb.SupervisorFrame_Job:
				if cur != nil && cur.terminalSent() {
					// The supervisor saw the terminal and sent the next job
					// before this loop saw the run end: it ends right now.
					<-cur.done
					if stop, err := finish(); stop {
						if err == nil {
							err = s.refuse(f.Job, CodeExecutorBusy, "this executor is not taking more jobs (Shutdown received or max_jobs_per_process served)", nil)
						}
						return err
					}
				}
				if cur != nil {
					s.e.log.Warn("protocol: a job arrived while another is running; refusing it", "job_id", f.Job.GetJobId(), "running_job_id", cur.job.ID)
					if err := s.refuse(f.Job, CodeExecutorBusy, fmt.Sprintf("job %q is still running; this executor runs one job at a time", cur.job.ID), nil); err != nil {
						return err
					}
					continue
				}
				h := s.handlers[f.Job.GetKind()]
				if h == nil {
					if err := s.refuse(f.Job, CodeUnsupportedKind, fmt.Sprintf("no handler for kind %q (this executor handles: %s)", f.Job.GetKind(), strings.Join(s.e.Kinds(), ", ")),
						// as the Python SDK's refusal says it (SDK audit)
						map[string]any{"kind": f.Job.GetKind(), "handled_kinds": s.e.Kinds()}); err != nil {
						return err
					}
					// a refused job is a job answered: it counts toward
					// MaxJobsPerProcess, as the supervisor and the Python
					// SDK count it (SDK audit: Go served N more after it)
					if stop, err := finish(); stop {
						return err
					}
					continue
				}
				cur = s.start(f.Job, h)

			case *pb.SupervisorFrame_Cancel:
				c := f.Cancel
				if cur == nil || c.GetJobId() != cur.job.ID {
					// Normal when a cancel crosses the job's terminal on the wire.
					s.e.log.Info("ignoring a cancel for a job that is not running", "job_id", c.GetJobId())
					continue
				}
				cur.cancel(&Cancellation{
					Reason:  strings.TrimPrefix(c.GetReason().String(), "CANCEL_REASON_"),
					Message: c.GetMessage(),
					Grace:   time.Duration(c.GetGraceMs()) * time.Millisecond,
				})

			case *pb.SupervisorFrame_Shutdown:
				if cur == nil {
					return nil
				}
				// No more jobs: let the running one finish, then return.
				shuttingDown = true

			default:
				// A frame type newer than this SDK: skip it.
				s.e.log.Warn("ignoring a supervisor frame of an unknown type")
			}
		}
	}
}

// endOfInput handles the end of stdin (clean EOF or a broken frame). A running
// job is cancelled (unless a Shutdown already asked it to finish) and given
// StopGrace to send its terminal.
func (s *session) endOfInput(cur *jobRun, err error, shuttingDown bool) error {
	var readErr error
	reason, msg := ReasonStdinClosed, "stdin closed while the job was running"
	if !errors.Is(err, io.EOF) {
		readErr = fmt.Errorf("executor: reading stdin: %w", err)
		reason, msg = ReasonProtocolError, readErr.Error()
	}
	if cur == nil {
		return readErr
	}
	if shuttingDown && readErr == nil {
		// Shutdown then EOF is the normal way to stop a persistent executor:
		// the running job finishes (the supervisor signals if it must end sooner).
		<-cur.done
		if err := s.w.broken(); err != nil {
			return fmt.Errorf("executor: %w", err)
		}
		return nil
	}
	cur.cancel(&Cancellation{Reason: reason, Message: msg})
	t := time.NewTimer(s.e.opts.StopGrace)
	defer t.Stop()
	select {
	case <-cur.done:
	case <-t.C:
		return errors.Join(readErr, fmt.Errorf("executor: the handler for job %q (kind %q) did not return within %s of being cancelled (%s)",
			cur.job.ID, cur.job.Kind, s.e.opts.StopGrace, reason))
	}
	if err := s.w.broken(); err != nil {
		return errors.Join(readErr, fmt.Errorf("executor: %w", err))
	}
	return readErr
}

// refuse answers a job with a JobError before ACCEPTED: the job was not run.
func (s *session) refuse(j *pb.Job, code, message string, details map[string]any) error {
	var d []byte
	if details != nil {
		// plain values (the job's kind, this executor's kinds): they encode
		d, _ = json.Marshal(details)
	}
	err := s.w.write(&pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: &pb.JobError{
		JobId:     j.GetJobId(),
		Sequence:  1,
		Code:      wireText(code),
		Message:   wireText(message),
		Retryable: false,
		Details:   d,
	}}})
	if errors.Is(err, errOutputBroken) {
		return fmt.Errorf("executor: refusing job %q: %w", j.GetJobId(), err)
	}
	if err != nil {
		s.e.log.Warn("refusing a job", "job_id", j.GetJobId(), "err", err)
	}
	return nil
}

func (s *session) start(p *pb.Job, h HandlerFunc) *jobRun {
	job := newJob(p)
	job.logger = jobLogger(s.e.log, job)
	cancelled, cancel := context.WithCancelCause(context.Background())
	run := &jobRun{job: job, w: s.w, max: writeLimit(s.e.opts.MaxFrameBytes, p.GetMaxFrameBytes()), done: make(chan struct{}), cancel: cancel, cancelled: cancelled}
	// the next attempt's job is this one with the last checkpoint in place of
	// this one's: it must fit this executor's own cap to be received at all
	run.ownMax = s.e.opts.MaxFrameBytes
	run.jobWithoutCheckpoint = deterministic.Size(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: p}}) -
		checkpointFieldLen(p.Checkpoint != nil, len(p.GetCheckpoint()))
	job.run = run
	ctx, stop := cancelled, context.CancelFunc(func() {})
	if d := s.contextDeadline(job, time.Now()); !d.IsZero() {
		ctx, stop = context.WithDeadline(cancelled, d)
	}
	go func() {
		defer stop()
		s.execute(ctx, run, h)
	}()
	return run
}

// contextDeadline is the deadline of the handler's context: the job's minus
// the slack (at most a tenth of what is left at now); zero for none.
func (s *session) contextDeadline(job *Job, now time.Time) time.Time {
	d := job.deadline()
	if d.IsZero() || s.e.opts.NoDeadline {
		return time.Time{}
	}
	slack := s.e.opts.DeadlineSlack
	if left := d.Sub(now); left < 10*slack {
		slack = max(left/10, 0)
	}
	return d.Add(-slack)
}

// handlerOutcome is what the handler did.
type handlerOutcome struct {
	res      *Result
	err      error
	panicked bool
	panicVal any
	stack    []byte
	exited   bool // runtime.Goexit: neither returned nor panicked
}

func callHandler(ctx context.Context, h HandlerFunc, job *Job) (o handlerOutcome) {
	o.exited = true
	defer func() {
		if p := recover(); p != nil {
			o.panicked, o.panicVal, o.stack, o.exited = true, p, debug.Stack(), false
		}
	}()
	o.res, o.err = h(ctx, job)
	o.exited = false
	return o
}

func (s *session) execute(ctx context.Context, run *jobRun, h HandlerFunc) {
	job := run.job
	defer close(run.done)
	defer run.cancel(context.Canceled) // release the context once the terminal is out

	// ACCEPTED and RUNNING in one write
	if err := run.sendEvents(
		&pb.ProgressEvent{JobId: job.ID, Kind: pb.EventKind_EVENT_KIND_ACCEPTED},
		&pb.ProgressEvent{JobId: job.ID, Kind: pb.EventKind_EVENT_KIND_RUNNING},
	); err != nil {
		// Without ACCEPTED the job must not run; the stream is broken anyway.
		job.logger.Error("cannot start the job; not running it", "err", err)
		return
	}

	// The terminal goes out from a deferred call so that a handler calling
	// runtime.Goexit (which unwinds without returning) still gets one.
	o := handlerOutcome{exited: true}
	defer func() {
		err := run.sendTerminal(s.terminal(ctx, job, o), s.shrink(job))
		if err != nil && !errors.Is(err, ErrJobFinished) { // finished: a raw terminal went out (internal/rawframe)
			job.logger.Error("sending the terminal", "err", err)
		}
	}()
	o = callHandler(ctx, h, job)
	if o.panicked {
		job.logger.Error("the handler panicked", "panic", fmt.Sprint(o.panicVal), "stack", string(o.stack))
	}
}

// terminal builds the job's terminal frame from the handler's outcome.
func (s *session) terminal(ctx context.Context, job *Job, o handlerOutcome) func(seq uint64) *pb.ExecutorFrame {
	cancelled := job.run.cancelled
	jobErr := func(code, message string, retryable bool, details []byte, retryDelay *uint64) func(uint64) *pb.ExecutorFrame {
		return func(seq uint64) *pb.ExecutorFrame {
			return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: &pb.JobError{
				JobId:            job.ID,
				Sequence:         seq,
				Code:             wireText(code),
				Message:          wireText(job.redact(message)),
				Retryable:        retryable,
				Details:          details,
				NextRetryDelayMs: retryDelay,
			}}}
		}
	}

	if cancelled.Err() != nil && (o.err != nil || o.panicked || o.exited) {
		// Cancelled and the handler did not finish: the job is CANCELLED, even
		// when its error does not wrap context.Canceled (a killed subprocess,
		// a closed connection): after a cancel a failure is most likely caused
		// by it. A result returned after the cancel is sent below as it is.
		c, ok := context.Cause(cancelled).(*Cancellation)
		if !ok {
			c = &Cancellation{Reason: "UNSPECIFIED", Message: fmt.Sprint(context.Cause(cancelled))}
		}
		message := c.Error()
		details := map[string]any{"reason": c.Reason}
		switch {
		case o.panicked:
			message += fmt.Sprintf("; the handler then panicked: %v", o.panicVal)
			// the supervisor keeps it beside its own cancel (PROTOCOL.md)
			details["handler_error"] = fmt.Sprintf("panic: %v", o.panicVal)
		case o.err != nil && !errors.Is(o.err, context.Canceled) && !errors.Is(o.err, context.Cause(cancelled)):
			message += "; the handler returned: " + o.err.Error()
			details["handler_error"] = o.err.Error()
		}
		return jobErr(CodeCancelled, message, false, s.details(job, details), nil)
	}

	switch {
	case o.exited:
		return jobErr(CodeHandlerPanic, "the handler called runtime.Goexit", true, nil, nil)
	case o.panicked:
		return jobErr(CodeHandlerPanic, fmt.Sprintf("the handler panicked: %v", o.panicVal), true, nil, nil)
	case o.err != nil:
		var xe *Error
		if !errors.As(o.err, &xe) {
			deadline, hasDeadline := ctx.Deadline()
			ranOut := errors.Is(ctx.Err(), context.DeadlineExceeded)
			if !errors.Is(o.err, context.DeadlineExceeded) && !ranOut {
				return jobErr(CodeHandlerError, o.err.Error(), true, nil, nil)
			}
			// Out of time: the job's deadline (minus the slack), or a
			// deadline of the handler's own.
			message := o.err.Error()
			var details map[string]any
			if hasDeadline {
				details = map[string]any{"context_deadline_unix_ms": deadline.UnixMilli()}
			}
			retryable := true
			if ranOut {
				message = fmt.Sprintf("the handler ran out of time: its context's deadline %s (the job's deadline minus %s) passed; it returned: %v",
					deadline.UTC().Format(time.RFC3339Nano), job.deadline().Sub(deadline), o.err)
				// the step's deadline, not the attempt's, was the one: no
				// attempt may run past it, so a retry would start only to
				// run out again within the slack (SDK audit: a doomed
				// extra attempt, its side effects repeated)
				if !job.Deadline.IsZero() && job.deadline().Equal(job.Deadline) {
					retryable = false
					message += "; that was the step's deadline, after which no attempt may run"
				}
			}
			return jobErr(CodeHandlerTimeout, message, retryable, s.details(job, details), nil)
		}
		code := xe.Code
		if code == "" {
			code = CodeHandlerError
		}
		message := xe.Message
		if o.err != error(xe) || message == "" {
			message = o.err.Error()
		}
		if !validCode(code) {
			// as the Python SDK refuses such a code when the error is made:
			// a step's non_retryable_codes and the supervisor's reports
			// name codes in UPPER_SNAKE_CASE, so a lower-case one would
			// slip past every policy written for it
			message = fmt.Sprintf("error code must be non-empty UPPER_SNAKE_CASE, got %q: %s", code, message)
			code = CodeHandlerError
		}
		var delay *uint64
		if xe.NextRetryDelay > 0 {
			ms := uint64((xe.NextRetryDelay + time.Millisecond - 1) / time.Millisecond)
			delay = &ms
		}
		return jobErr(code, message, !xe.NonRetryable, s.details(job, xe.Details), delay)
	}

	output := []byte("null")
	var artifacts []Artifact
	if o.res != nil {
		if len(o.res.Output) > 0 {
			output = o.res.Output
		}
		artifacts = o.res.Artifacts
	}
	if !json.Valid(output) {
		return jobErr(CodeOutputInvalid, fmt.Sprintf("the handler's output is not valid JSON (%d bytes)", len(output)), false, nil, nil)
	}
	entries := make([]*pb.ArtifactManifestEntry, 0, len(artifacts))
	for _, a := range artifacts {
		if !localPath(filepath.FromSlash(a.Path)) {
			return jobErr(CodeArtifactInvalid, fmt.Sprintf("artifact %q: path %q is not a relative path inside the output directory", a.Name, a.Path), false, nil, nil)
		}
		if err := checkArtifactText(a); err != nil {
			return jobErr(CodeArtifactInvalid, fmt.Sprintf("artifact %q: %v", a.Name, err), false, nil, nil)
		}
		entries = append(entries, &pb.ArtifactManifestEntry{
			Name:        a.Name,
			Path:        a.Path,
			Sha256:      a.SHA256,
			Size:        a.Size,
			MediaType:   a.MediaType,
			DerivedFrom: a.DerivedFrom,
		})
	}
	return func(seq uint64) *pb.ExecutorFrame {
		return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Result{Result: &pb.JobResult{
			JobId:     job.ID,
			Sequence:  seq,
			Output:    output,
			Artifacts: entries,
		}}}
	}
}

// shrink builds the replacement terminal when the real one is over the frame cap.
func (s *session) shrink(job *Job) func(seq uint64, tooLarge error) *pb.ExecutorFrame {
	return func(seq uint64, tooLarge error) *pb.ExecutorFrame {
		job.logger.Warn("the terminal frame is over the frame cap; sending RESULT_TOO_LARGE", "err", tooLarge)
		return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: &pb.JobError{
			JobId:     job.ID,
			Sequence:  seq,
			Code:      CodeResultTooLarge,
			Message:   truncateUTF8(wireText(tooLarge.Error()+"; write large outputs as artifacts"), 1024),
			Retryable: false,
		}}}
	}
}

// details encodes a JobError's details object, with the job's secrets
// redacted from every string in it (keys included).
func (s *session) details(job *Job, d map[string]any) []byte {
	if d == nil {
		return nil
	}
	b, err := json.Marshal(d)
	if err != nil {
		job.logger.Warn("dropping error details that do not encode as JSON", "err", err)
		return nil
	}
	if job.red == nil {
		return b
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		job.logger.Warn("dropping error details", "err", err)
		return nil
	}
	red, err := json.Marshal(job.red.value(v))
	if err != nil {
		job.logger.Warn("dropping error details", "err", err)
		return nil
	}
	return red
}

func truncateUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
