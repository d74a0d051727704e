package executor_test

import (
	"bytes"
	"context"
	"fmt"
	"os"

	"github.com/durable-runtime/durable/executors-go/executor"
)

// An executor with one handler, run as the supervisor starts it. (This and
// ExampleHandleJSON are the README's examples: README_test.go checks that the
// README shows this very code.)
func Example() {
	executor.ClaimStdio() // first: what prints before Run goes to stderr, not ahead of the hello
	ex := executor.New(executor.Options{
		ExecutorKind: "go",
		Labels:       map[string]string{"gpu": "a100"},
	})
	ex.Handle("report.render", func(ctx context.Context, job *executor.Job) (*executor.Result, error) {
		var in struct {
			Pages int `json:"pages"`
		}
		if err := job.DecodeInput(&in); err != nil {
			return nil, err // BAD_INPUT, not retryable
		}
		log := job.Logger() // job_id, kind and attempt on every line, on stderr
		var pdf bytes.Buffer
		for p := 1; p <= in.Pages; p++ {
			if err := ctx.Err(); err != nil {
				return nil, err // cancelled: CANCELLED; out of time: HANDLER_TIMEOUT
			}
			fmt.Fprintf(&pdf, "page %d\n", p) // ... render page p ...
			log.Info("rendered a page", "page", p)
			if err := job.ProgressWithCheckpoint("rendered a page", float64(p)/float64(in.Pages), []byte{byte(p)}); err != nil {
				return nil, err
			}
		}
		path, err := job.OutputPath("report.pdf")
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(path, pdf.Bytes(), 0o644); err != nil {
			return nil, err // HANDLER_ERROR, retryable
		}
		art, err := job.FileArtifact("report.pdf", &executor.ArtifactOptions{MediaType: "application/pdf"})
		if err != nil {
			return nil, err
		}
		return executor.NewResult(map[string]int{"pages": in.Pages}, art)
	})
	os.Exit(ex.Run())
}

type resizeIn struct {
	URL   string `json:"url"`
	Width int    `json:"width"`
}

type resizeOut struct {
	Width  int `json:"width"`
	Height int `json:"height"`
}

// A typed handler: the input JSON decoded into resizeIn, the output encoded
// from resizeOut.
func ExampleHandleJSON() {
	ex := executor.New(executor.Options{})
	executor.HandleJSON(ex, "image.resize", func(ctx context.Context, job *executor.Job, in resizeIn) (resizeOut, error) {
		if in.Width <= 0 {
			return resizeOut{}, &executor.Error{Code: "BAD_WIDTH", Message: fmt.Sprintf("width %d", in.Width), NonRetryable: true}
		}
		// ... fetch in.URL with ctx (it carries the job's deadline) and resize ...
		return resizeOut{Width: in.Width, Height: in.Width * 3 / 4}, nil
	})
	os.Exit(ex.Run())
}

// importState is what importRows checkpoints: the first row not yet imported.
type importState struct {
	Next int `json:"next"`
}

// importRows resumes where the previous attempt's checkpoint says: after a
// crash or a retry it continues at the first row not yet imported, not at 0.
func importRows(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	const rows = 10
	var state importState // zero (row 0) when there is no checkpoint
	if _, err := job.DecodeCheckpoint(&state); err != nil {
		return nil, err // BAD_CHECKPOINT, not retryable
	}
	for row := state.Next; row < rows; row++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		// ... import row (keyed on job.IdempotencyKey and row: redoing one is harmless) ...
		done := importState{Next: row + 1}
		if err := job.ProgressWithCheckpointJSON("imported a row", float64(done.Next)/rows, done); err != nil {
			return nil, err
		}
	}
	return executor.NewResult(map[string]int{"resumed_at": state.Next})
}

// A step that resumes from its checkpoint (importRows; TestImportRowsResumes
// runs it).
func ExampleJob_DecodeCheckpoint() {
	ex := executor.New(executor.Options{})
	ex.Handle("rows.import", importRows)
	os.Exit(ex.Run())
}
