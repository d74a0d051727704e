// Package rawframe lets code of this module write on a job's frame stream
// around the SDK's framing, sequencing and one-terminal rule. The demo
// executor's demo.misbehave kind uses it to produce the broken streams the
// supervisor's tests need; being internal, it is out of reach of real
// executors, which have no business breaking the protocol.
package rawframe

import (
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// Writer is the raw side of one running job's frame stream.
type Writer interface {
	// WriteRaw writes b verbatim on the frame stream: no length prefix, no
	// sequence, no check.
	WriteRaw(b []byte) error
	// SendFrame writes f as is (its job_id and sequence untouched). A JobResult
	// or JobError sent this way counts as the job's terminal: the SDK sends
	// none of its own afterwards (the job still runs until its handler
	// returns).
	SendFrame(f *pb.ExecutorFrame) error
}

// Of returns the raw writer of job, a *executor.Job handed to a running
// handler. Package executor sets it when it is initialised.
var Of func(job any) Writer
