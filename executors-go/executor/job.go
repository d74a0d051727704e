package executor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"path/filepath"
	"strings"
	"sync"
	"time"

	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// Job is one attempt of one step, as the supervisor sent it, plus the methods a
// handler uses to report progress. Handlers must not modify its fields.
type Job struct {
	// ID is the supervisor's correlation id, unique per attempt.
	ID            string
	WorkflowRunID string
	StepRunID     string
	// IdempotencyKey is stable across every attempt of the step: key side
	// effects on it.
	IdempotencyKey string
	ExecutorKind   string
	Kind           string
	// Attempt is 1 for the first attempt.
	Attempt uint32
	// Deadline is the step deadline (all attempts); zero when none.
	Deadline time.Time
	// AttemptDeadline is the end of this attempt; zero when none. The
	// supervisor enforces both deadlines (by sending Cancel, then signals);
	// the handler's context carries the earlier of the two, minus
	// Options.DeadlineSlack, so that a handler that runs into it returns
	// first (HANDLER_TIMEOUT, retryable).
	AttemptDeadline time.Time
	// HeartbeatTimeout: silence (no frame) longer than this ends the attempt;
	// zero when none. Long handlers call Progress or Heartbeat well within it.
	HeartbeatTimeout time.Duration

	// Input is the step's input JSON value, UTF-8 encoded (may be empty).
	Input []byte
	// InputArtifacts are the dependencies' artifacts, on local disk.
	InputArtifacts []ArtifactRef

	// PreviousCheckpoint is the last checkpoint an earlier attempt reported;
	// HasPreviousCheckpoint tells an absent checkpoint from an empty one.
	PreviousCheckpoint    []byte
	HasPreviousCheckpoint bool

	// OutputDir is an empty directory owned by this attempt; artifacts are
	// written below it.
	OutputDir string

	// Secrets the step named, for this attempt only. Never log or echo them.
	Secrets map[string]string
	// Labels are the step's labels.
	Labels map[string]string

	// ProtocolVersion is the protocol revision the supervisor chose ("1.1");
	// empty from a supervisor that does not negotiate (1.0). Features are the
	// features it agreed to (see FeatureFrameLimits).
	ProtocolVersion string
	Features        []string

	run    *jobRun
	red    *redactor
	logger *slog.Logger
}

// ArtifactRef is an input artifact, materialised read-only on local disk.
type ArtifactRef struct {
	ID        string
	Name      string
	SHA256    string
	Size      uint64
	MediaType string
	// Path is the absolute local path of the bytes.
	Path string
	// StepName is the step that produced it.
	StepName string
}

func newJob(p *pb.Job) *Job {
	j := &Job{
		ID:                    p.GetJobId(),
		WorkflowRunID:         p.GetWorkflowRunId(),
		StepRunID:             p.GetStepRunId(),
		IdempotencyKey:        p.GetIdempotencyKey(),
		ExecutorKind:          p.GetExecutorKind(),
		Kind:                  p.GetKind(),
		Attempt:               p.GetAttempt(),
		Deadline:              unixMs(p.GetDeadlineUnixMs()),
		AttemptDeadline:       unixMs(p.GetAttemptDeadlineUnixMs()),
		HeartbeatTimeout:      time.Duration(p.GetHeartbeatTimeoutMs()) * time.Millisecond,
		Input:                 p.GetInput(),
		PreviousCheckpoint:    p.GetCheckpoint(),
		HasPreviousCheckpoint: p.Checkpoint != nil,
		OutputDir:             p.GetOutputDir(),
		Secrets:               p.GetSecrets(),
		Labels:                p.GetLabels(),
		ProtocolVersion:       p.GetNegotiatedVersion(),
		Features:              p.GetNegotiatedFeatures(),
	}
	if j.HasPreviousCheckpoint && j.PreviousCheckpoint == nil {
		j.PreviousCheckpoint = []byte{}
	}
	if j.Secrets == nil {
		j.Secrets = map[string]string{}
	}
	if j.Labels == nil {
		j.Labels = map[string]string{}
	}
	j.red = newRedactor(j.Secrets)
	for _, a := range p.GetInputArtifacts() {
		j.InputArtifacts = append(j.InputArtifacts, ArtifactRef{
			ID:        a.GetId(),
			Name:      a.GetName(),
			SHA256:    a.GetSha256(),
			Size:      a.GetSize(),
			MediaType: a.GetMediaType(),
			Path:      a.GetPath(),
			StepName:  a.GetStepName(),
		})
	}
	return j
}

func unixMs(ms int64) time.Time {
	if ms == 0 {
		return time.Time{}
	}
	return time.UnixMilli(ms)
}

// deadline is the earlier of AttemptDeadline and Deadline; zero when neither
// is set.
func (j *Job) deadline() time.Time {
	d := j.AttemptDeadline
	if d.IsZero() || (!j.Deadline.IsZero() && j.Deadline.Before(d)) {
		d = j.Deadline
	}
	return d
}

// Logger returns the job's logger: the executor's (Options.Logger; by
// default text on stderr, which the supervisor keeps the tail of as the
// attempt's log) with the attributes job_id, kind and attempt. The job's
// secret values are redacted from messages and attributes, as from frames.
func (j *Job) Logger() *slog.Logger {
	if j.logger == nil {
		j.logger = jobLogger(slog.Default(), j)
	}
	return j.logger
}

func jobLogger(base *slog.Logger, j *Job) *slog.Logger {
	h := base.Handler()
	if j.red != nil {
		h = &redactingHandler{h: h, r: j.red}
	}
	return slog.New(h).With(slog.String("job_id", j.ID), slog.String("kind", j.Kind), slog.Uint64("attempt", uint64(j.Attempt)))
}

// DecodeInput unmarshals the input JSON into v. An empty input or JSON null
// leaves v unchanged. On failure it returns an *Error with code BAD_INPUT (not
// retryable), so a handler can return it as is.
func (j *Job) DecodeInput(v any) error {
	in := bytes.TrimSpace(j.Input)
	if len(in) == 0 {
		return nil
	}
	if err := json.Unmarshal(in, v); err != nil {
		return &Error{Code: CodeBadInput, Message: fmt.Sprintf("input for kind %q: %v", j.Kind, err), NonRetryable: true, Err: err}
	}
	return nil
}

// OutputPath returns OutputDir joined with rel, refusing paths that would
// escape it (absolute, or containing ".."): any ".." part is refused, even
// one that stays inside (as the Python SDK's output_path and PROTOCOL.md's
// artifact paths do).
func (j *Job) OutputPath(rel string) (string, error) {
	if !localPath(rel) || strings.ContainsRune(rel, 0) {
		return "", fmt.Errorf("executor: output path %q is not a relative path inside the output directory", rel)
	}
	if j.OutputDir == "" {
		return "", errors.New("executor: the job has no output directory")
	}
	return filepath.Join(j.OutputDir, rel), nil
}

// NoFraction as Progress's fraction sends the event without a fraction (for
// progress whose extent is unknown). It is NaN: test a value with math.IsNaN,
// not ==. A fraction computed as 0/0 is NaN too, and so sends none.
var NoFraction = math.NaN()

// Progress sends a PROGRESS event: a message and the fraction done. A
// fraction outside 0..1 is clamped into it (a computation that overshoots is
// not worth failing a job for); NaN (NoFraction) and ±Inf send no fraction. Invalid
// UTF-8 and NUL in message are sent as U+FFFD (see wireText).
func (j *Job) Progress(message string, fraction float64) error {
	return j.send(pb.EventKind_EVENT_KIND_PROGRESS, message, fraction, nil)
}

// ProgressWithCheckpoint sends a PROGRESS event carrying a checkpoint: opaque
// resume state the supervisor stores and hands to the next attempt as
// PreviousCheckpoint. A nil checkpoint is sent as an empty one. fraction is as
// for Progress.
func (j *Job) ProgressWithCheckpoint(message string, fraction float64, checkpoint []byte) error {
	if checkpoint == nil {
		checkpoint = []byte{}
	}
	return j.send(pb.EventKind_EVENT_KIND_PROGRESS, message, fraction, checkpoint)
}

// ProgressWithCheckpointJSON is ProgressWithCheckpoint with v encoded as
// JSON: the counterpart of DecodeCheckpoint.
func (j *Job) ProgressWithCheckpointJSON(message string, fraction float64, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("executor: encoding the checkpoint: %w", err)
	}
	return j.ProgressWithCheckpoint(message, fraction, b)
}

// DecodeCheckpoint decodes the previous attempt's checkpoint, as JSON, into
// v and reports whether there was one: false, with v untouched, when no
// earlier attempt reported a checkpoint (or it was empty), so a handler
// resumes from v when ok and starts from the beginning otherwise. A
// checkpoint that is not that JSON is an *Error with CodeBadCheckpoint (not
// retryable: the next attempt would get the same one).
func (j *Job) DecodeCheckpoint(v any) (ok bool, err error) {
	cp := bytes.TrimSpace(j.PreviousCheckpoint)
	if !j.HasPreviousCheckpoint || len(cp) == 0 {
		return false, nil
	}
	if err := json.Unmarshal(cp, v); err != nil {
		return false, &Error{Code: CodeBadCheckpoint, Message: fmt.Sprintf("the previous checkpoint of %q is not the JSON expected: %v", j.Kind, err), NonRetryable: true, Err: err}
	}
	return true, nil
}

// Checkpoint sends a HEARTBEAT event carrying a checkpoint (see
// ProgressWithCheckpoint).
func (j *Job) Checkpoint(checkpoint []byte) error {
	if checkpoint == nil {
		checkpoint = []byte{}
	}
	return j.send(pb.EventKind_EVENT_KIND_HEARTBEAT, "", NoFraction, checkpoint)
}

// Heartbeat sends a HEARTBEAT event: liveness only, it resets the supervisor's
// heartbeat timeout.
func (j *Job) Heartbeat() error {
	return j.send(pb.EventKind_EVENT_KIND_HEARTBEAT, "", NoFraction, nil)
}

func (j *Job) send(kind pb.EventKind, message string, fraction float64, checkpoint []byte) error {
	if j.run == nil {
		return errors.New("executor: the job is not running (a Job built by hand cannot send events)")
	}
	ev := &pb.ProgressEvent{
		JobId:      j.ID,
		Kind:       kind,
		Message:    wireText(j.redact(message)),
		Checkpoint: checkpoint,
	}
	// ±Inf (x/0) sends none too: a division by zero is no 100 % (PROTOCOL.md)
	if !math.IsNaN(fraction) && !math.IsInf(fraction, 0) {
		f := min(max(fraction, 0), 1)
		ev.Fraction = &f
	}
	return j.run.sendEvent(ev)
}

// redact replaces the job's secret values found in s with "[REDACTED]" (the
// rules are the supervisor's: see redactor).
func (j *Job) redact(s string) string {
	return j.red.str(s)
}

// jobRun is the SDK side of one running job: its context, sequence counter and
// the one-terminal guarantee.
type jobRun struct {
	job  *Job
	w    *frameWriter
	max  int           // the cap on this job's frames (writeLimit)
	done chan struct{} // closed once the terminal was sent (or could not be)

	// the executor's own cap on frames it reads, and this job's frame
	// without its checkpoint: what a checkpoint must leave the next attempt
	ownMax               int
	jobWithoutCheckpoint int

	cancel    func(error)
	cancelled context.Context // cancelled by cancel: a Cancel frame, stdin ending, the output breaking

	mu       sync.Mutex
	seq      uint64
	finished bool
}

// sendEvent numbers and writes an event, unless the terminal has been sent.
func (r *jobRun) sendEvent(ev *pb.ProgressEvent) error {
	return r.sendEvents(ev)
}

// sendEvents numbers events and writes them in one Write, unless the terminal
// has been sent: one system call, and one wake-up of the supervisor's reader,
// for the job's automatic ACCEPTED and RUNNING.
func (r *jobRun) sendEvents(evs ...*pb.ProgressEvent) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished {
		return ErrJobFinished
	}
	now := time.Now().UnixMilli()
	var buf []byte
	kinds := make([]string, 0, len(evs))
	for i, ev := range evs {
		ev.Sequence = r.seq + uint64(i) + 1
		ev.AtUnixMs = now
		kinds = append(kinds, ev.Kind.String())
		b, err := appendFrame(buf, &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Event{Event: ev}}, r.max)
		if err != nil {
			return fmt.Errorf("executor: sending %s event: %w", ev.Kind, err)
		}
		if ev.Checkpoint != nil {
			if err := r.nextJobFits(len(ev.Checkpoint)); err != nil {
				return fmt.Errorf("executor: sending %s event: %w", ev.Kind, err)
			}
		}
		buf = b
	}
	if err := r.w.writeRaw(buf); err != nil {
		if errors.Is(err, errOutputBroken) {
			r.cancel(&Cancellation{Reason: ReasonOutputBroken, Message: err.Error()})
		}
		return fmt.Errorf("executor: sending %s event: %w", strings.Join(kinds, " and "), err)
	}
	r.seq += uint64(len(evs))
	return nil
}

// nextJobFits refuses a checkpoint of n bytes that would leave the next
// attempt's job frame over the executor's own cap (ErrCheckpointTooLarge).
// Room is left for the job's paths to differ on the next attempt (4 KiB
// each); secret values that grow cannot be foreseen. A jobRun made without
// a job frame (ownMax 0) checks nothing.
func (r *jobRun) nextJobFits(n int) error {
	if r.ownMax <= 0 {
		return nil
	}
	next := r.jobWithoutCheckpoint + checkpointFieldLen(true, n) + nextJobSlack +
		pathRoom*(1+len(r.job.InputArtifacts))
	if next > r.ownMax {
		return fmt.Errorf("%w: a checkpoint of %d bytes would make it about %d bytes, over this executor's frame cap of %d bytes (Options.MaxFrameBytes), so the next attempt could not receive it; keep checkpoints smaller (large state belongs in artifacts)",
			ErrCheckpointTooLarge, n, next, r.ownMax)
	}
	return nil
}

// terminalSent reports whether the job's terminal frame has gone out.
func (r *jobRun) terminalSent() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.finished
}

// sendTerminal writes the job's one terminal frame; build gets the sequence.
// When that frame is over the frame cap, the frame shrink builds (same
// sequence) is sent instead, so the job still ends with exactly one terminal.
func (r *jobRun) sendTerminal(build func(seq uint64) *pb.ExecutorFrame, shrink func(seq uint64, tooLarge error) *pb.ExecutorFrame) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.finished {
		return ErrJobFinished
	}
	r.finished = true
	r.seq++
	f := build(r.seq)
	err := r.w.writeMax(f, r.max)
	if errors.Is(err, ErrFrameTooLarge) && shrink != nil {
		f = shrink(r.seq, err)
		err = r.w.writeMax(f, r.max)
	}
	if err != nil && !errors.Is(err, errOutputBroken) && !errors.Is(err, ErrFrameTooLarge) {
		// The frame does not encode (a string field that is not UTF-8): send
		// one that does rather than no terminal at all.
		fallback := unencodableTerminal(r.job.ID, r.seq, f, err)
		r.job.Logger().Error("the terminal frame does not encode; sending a replacement", "err", err, "replacement", fallback.GetError().GetMessage())
		err = r.w.writeMax(fallback, r.max)
	}
	return err
}

// WriteRaw implements rawframe.Writer (demo.misbehave only).
func (r *jobRun) WriteRaw(b []byte) error {
	return r.w.writeRaw(b)
}

// SendFrame implements rawframe.Writer (demo.misbehave only).
func (r *jobRun) SendFrame(f *pb.ExecutorFrame) error {
	b, err := MarshalFrame(f)
	if err != nil {
		return err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if f.GetResult() != nil || f.GetError() != nil {
		r.finished = true
	}
	return r.w.writeRaw(b)
}

// localPath tells whether p is a relative path with no ".." part: what
// OutputPath and an artifact's manifest path may be.
func localPath(p string) bool {
	if !filepath.IsLocal(p) {
		return false
	}
	for _, part := range strings.Split(filepath.ToSlash(p), "/") {
		if part == ".." {
			return false
		}
	}
	return true
}
