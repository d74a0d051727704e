// Package executor is the Go SDK for durable executors: child processes that
// run workflow steps for the supervisor and speak the executor protocol v1
// (proto/durable/executor/v1/executor.proto, rules in proto/PROTOCOL.md) as
// varint-length-delimited protobuf frames on stdin and stdout.
//
// An executor registers one handler per job kind and runs:
//
//	func main() {
//		ex := executor.New(executor.Options{ExecutorKind: "go"})
//		ex.Handle("thumbnail.make", func(ctx context.Context, job *executor.Job) (*executor.Result, error) {
//			var in struct{ Width int `json:"width"` }
//			if err := job.DecodeInput(&in); err != nil {
//				return nil, err // BAD_INPUT
//			}
//			if err := job.Progress("resizing", 0.5); err != nil {
//				return nil, err
//			}
//			// ... write job.OutputDir/thumb.png, honouring ctx ...
//			art, err := job.FileArtifact("thumbnail", "thumb.png", "image/png")
//			if err != nil {
//				return nil, err
//			}
//			return executor.NewResult(map[string]int{"width": in.Width}, art)
//		})
//		os.Exit(ex.Run())
//	}
//
// The SDK sends Hello, answers each Job with ACCEPTED and RUNNING events, runs
// the handler with a context that a Cancel frame cancels, and sends exactly one
// terminal (JobResult or JobError) per job. Run keeps stray writes to stdout
// off the frame stream; Serve runs the same protocol on any reader and writer
// (tests).
package executor
