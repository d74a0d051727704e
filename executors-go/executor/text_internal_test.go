package executor

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// A terminal that does not encode (protobuf refuses invalid UTF-8 in a
// string field) is replaced by a JobError that does, with the same sequence
// and naming the field: the job still ends with exactly one terminal. The
// SDK's own terminals are built valid; this is the last line of defence.
func TestATerminalThatDoesNotEncodeIsReplacedByOneThatDoes(t *testing.T) {
	cases := []struct {
		name      string
		frame     func(seq uint64) *pb.ExecutorFrame
		code      string
		retryable bool
		field     string
	}{
		{"result", func(seq uint64) *pb.ExecutorFrame {
			return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Result{Result: &pb.JobResult{JobId: "j", Sequence: seq, Output: []byte("1"),
				Artifacts: []*pb.ArtifactManifestEntry{{Name: "fine", Path: "fine"}, {Name: "bad", Path: "r\xff.csv"}}}}}
		}, CodeOutputInvalid, false, "result.artifacts[1].path"},
		{"retryable error", func(seq uint64) *pb.ExecutorFrame {
			return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: &pb.JobError{JobId: "j", Sequence: seq, Code: "MINE", Message: "m\xff", Retryable: true}}}
		}, CodeHandlerError, true, "error.message"},
		{"error", func(seq uint64) *pb.ExecutorFrame {
			return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: &pb.JobError{JobId: "j", Sequence: seq, Code: "MINE\xff"}}}
		}, CodeHandlerError, false, "error.code"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out bytes.Buffer
			j := &Job{ID: "j", logger: slog.New(slog.DiscardHandler)}
			run := &jobRun{job: j, w: &frameWriter{w: &out, max: DefaultMaxFrameBytes}, max: DefaultMaxFrameBytes,
				done: make(chan struct{}), cancel: func(error) {}}
			run.seq = 4
			err := run.sendTerminal(c.frame, nil)
			f := &pb.ExecutorFrame{}
			if rerr := NewFrameReader(&out, 0).Read(f); rerr != nil {
				t.Fatalf("no terminal went out (sendTerminal: %v): %v", err, rerr)
			}
			e := f.GetError()
			if e.GetJobId() != "j" || e.GetSequence() != 5 || e.GetCode() != c.code || e.GetRetryable() != c.retryable ||
				!strings.Contains(e.GetMessage(), c.field) || !strings.Contains(e.GetMessage(), "UTF-8") {
				t.Fatalf("replacement terminal = %v; want %s (retryable %v) naming %s", f, c.code, c.retryable, c.field)
			}
			if !run.terminalSent() || out.Len() != 0 {
				t.Fatalf("terminal sent %v, %d more bytes", run.terminalSent(), out.Len())
			}
			if err := run.sendTerminal(c.frame, nil); err != ErrJobFinished {
				t.Fatalf("a second terminal: %v, want ErrJobFinished", err)
			}
		})
	}
}
