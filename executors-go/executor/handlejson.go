package executor

import "context"

// HandleJSON registers a typed handler for a job kind: the job's input JSON
// is decoded into an In (an empty input or JSON null leaves it the zero
// value) and fn's Out is encoded as the output JSON.
//
// Input that does not decode into In ends the job with BAD_INPUT (not
// retryable), reported after ACCEPTED like any failure of the job (PROTOCOL.md:
// the job was received and tried; respawning cannot fix it). An Out that JSON
// cannot encode ends it with OUTPUT_INVALID (not retryable). fn's error is
// reported as a HandlerFunc's is. To attach artifacts, use *Result as Out: it
// is sent as it is.
//
// It panics as Handle does (and on a nil fn).
func HandleJSON[In, Out any](e *Executor, kind string, fn func(ctx context.Context, job *Job, in In) (Out, error)) {
	if fn == nil {
		panic("executor: HandleJSON(" + kind + ") with a nil handler")
	}
	e.Handle(kind, func(ctx context.Context, job *Job) (*Result, error) {
		var in In
		if err := job.DecodeInput(&in); err != nil {
			return nil, err
		}
		out, err := fn(ctx, job, in)
		if err != nil {
			return nil, err
		}
		if r, ok := any(out).(*Result); ok {
			return r, nil
		}
		return NewResult(out)
	})
}
