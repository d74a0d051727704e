package executor

import (
	"errors"
	"fmt"
	"time"
)

// Error codes the SDK produces: every code of proto/PROTOCOL.md's "Stable
// error codes" table whose producer includes the SDK. Handlers choose their
// own UPPER_SNAKE_CASE codes; these are reserved.
const (
	// CodeCancelled: the job stopped because of a Cancel frame (or stdin closed,
	// or the frame stream broke, while it ran). Not retryable.
	CodeCancelled = "CANCELLED"
	// CodeUnsupportedKind: refusal, no handler is registered for the job's kind.
	CodeUnsupportedKind = "UNSUPPORTED_KIND"
	// CodeExecutorBusy: refusal, a Job arrived while another job was running
	// (the supervisor sends one job at a time; this guards against a bug).
	CodeExecutorBusy = "EXECUTOR_BUSY"
	// CodeHandlerPanic: the handler panicked (or called runtime.Goexit).
	// Retryable.
	CodeHandlerPanic = "HANDLER_PANIC"
	// CodeHandlerError: the handler returned an error that is not an *Error.
	// Retryable.
	CodeHandlerError = "HANDLER_ERROR"
	// CodeHandlerTimeout: the handler returned context.DeadlineExceeded (or an
	// error wrapping it), or any plain error once its context's deadline had
	// passed: it ran out of time. Retryable. The context's deadline is the
	// job's (see Options.DeadlineSlack), so this code normally arrives just
	// before the supervisor would end the attempt with its own
	// ATTEMPT_TIMEOUT or DEADLINE_EXCEEDED.
	CodeHandlerTimeout = "HANDLER_TIMEOUT"
	// CodeBadInput: the job's input could not be decoded (Job.DecodeInput,
	// HandleJSON). Not retryable.
	CodeBadInput = "BAD_INPUT"
	// CodeOutputInvalid: the handler's output is not valid JSON, or its value
	// cannot be encoded as JSON (NewResult, HandleJSON). Not retryable (the
	// supervisor would reject it with the same code).
	CodeOutputInvalid = "OUTPUT_INVALID"
	// CodeArtifactInvalid: an artifact the handler listed is not a regular
	// file below Job.OutputDir (Job.FileArtifact, or a manifest path that
	// escapes the directory). Not retryable.
	CodeArtifactInvalid = "ARTIFACT_INVALID"
	// CodeResultTooLarge: the terminal frame would exceed the frame cap. Not
	// retryable.
	CodeResultTooLarge = "RESULT_TOO_LARGE"
	// CodeBadCheckpoint: DecodeCheckpoint found a previous checkpoint that is
	// not the JSON asked for (not retryable: the next attempt gets the same).
	CodeBadCheckpoint = "BAD_CHECKPOINT"
)

// Error is a handler failure with a stable code. Return it (or an error wrapping
// it) from a handler to control the JobError the supervisor receives:
//
//	return nil, &executor.Error{Code: "UPSTREAM_DOWN", Message: "api.example.com: 503"}
//	return nil, &executor.Error{Code: "NO_SUCH_USER", Message: "user 42", NonRetryable: true}
//
// A failure is retryable unless it says otherwise, as in the Python SDK: an
// *Error is retryable unless NonRetryable is set, and any other error becomes
// JobError{code: "HANDLER_ERROR", retryable: true}. ("Retryable" is the
// default the step's retry policy starts from; its non_retryable_codes can
// still make any code terminal.)
type Error struct {
	// Code is stable, machine-readable, UPPER_SNAKE_CASE. Empty means
	// "HANDLER_ERROR"; so does a code that is not UPPER_SNAKE_CASE, with a
	// message naming it (as the Python SDK refuses such a code).
	Code string
	// Message is for humans. Never put secret values in it (the SDK replaces
	// the job's secret values it finds with "[REDACTED]", but do not rely on it).
	Message string
	// NonRetryable marks a failure that another attempt cannot fix (bad
	// input, a permanent refusal upstream). The zero value is retryable.
	NonRetryable bool
	// Details is sent as a JSON object; nil means none.
	Details map[string]any
	// NextRetryDelay, when positive, replaces the retry policy's backoff for
	// the next attempt (rounded up to whole milliseconds), within the step's
	// retry.max_interval_ms: a longer delay waits max_interval_ms (the spec's
	// author bounds how long any retry waits). Zero means "use the policy".
	NextRetryDelay time.Duration
	// Err is an optional underlying cause, reachable with errors.Unwrap. It is
	// not sent.
	Err error
}

// Errorf returns an *Error with a formatted message, retryable or not. A %w
// verb in format sets Err as fmt.Errorf would.
func Errorf(code string, retryable bool, format string, args ...any) *Error {
	wrapped := fmt.Errorf(format, args...)
	return &Error{Code: code, Message: wrapped.Error(), NonRetryable: !retryable, Err: errors.Unwrap(wrapped)}
}

func (e *Error) Error() string {
	code := e.Code
	if code == "" {
		code = CodeHandlerError
	}
	if e.Message == "" {
		return code
	}
	return code + ": " + e.Message
}

func (e *Error) Unwrap() error { return e.Err }

// ErrJobFinished is returned by Job's event methods once the job's terminal
// frame has been sent (for example from a goroutine that outlived its handler).
var ErrJobFinished = errors.New("executor: job already finished")

// Cancellation is the cause of a handler's context cancellation:
// context.Cause(ctx) returns a *Cancellation once the job is cancelled.
type Cancellation struct {
	// Reason is the Cancel frame's reason without its prefix ("REQUESTED",
	// "ATTEMPT_TIMEOUT", "DEADLINE", "LEASE_LOST", "SHUTDOWN", "UNSPECIFIED"),
	// or, when no Cancel frame was received, "STDIN_CLOSED" (the supervisor
	// closed stdin mid-job), "PROTOCOL_ERROR" (stdin carried a broken frame) or
	// "OUTPUT_BROKEN" (the frame stream could not be written).
	Reason string
	// Message is the Cancel frame's message, or the SDK's explanation.
	Message string
	// Grace is how long the supervisor waits for the terminal before it signals
	// the process group (0 when unknown).
	Grace time.Duration
}

// Cancellation reasons the SDK produces itself (no Cancel frame).
const (
	ReasonStdinClosed   = "STDIN_CLOSED"
	ReasonProtocolError = "PROTOCOL_ERROR"
	ReasonOutputBroken  = "OUTPUT_BROKEN"
)

func (c *Cancellation) Error() string {
	if c.Message == "" {
		return "job cancelled (" + c.Reason + ")"
	}
	return "job cancelled (" + c.Reason + "): " + c.Message
}

// validCode tells whether code is UPPER_SNAKE_CASE: capital letters, digits
// and underscores, at least one character.
func validCode(code string) bool {
	if code == "" {
		return false
	}
	for _, c := range code {
		if !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return true
}
