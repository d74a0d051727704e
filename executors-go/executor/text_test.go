package executor_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
)

// Text the SDK puts into a frame's string fields is sent as valid wire text:
// invalid UTF-8 (which protobuf refuses to encode) and NUL (which the
// supervisor refuses as PROTOCOL_INVALID_TEXT) become U+FFFD, in event
// messages and in an error's code and message, as the Python SDK does. Every
// job still ends with its one terminal, carrying the handler's own outcome.
func TestTextIsSentAsValidWireText(t *testing.T) {
	badName := filepath.Join(t.TempDir(), "report-\xff.csv") // a non-UTF-8 file name
	ex := newExecutor(executor.Options{})
	ex.Handle("progress", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		if err := j.Progress("bad \xff utf8, nul \x00 here", 0.5); err != nil {
			return nil, err // before the fix: "string field contains invalid UTF-8"
		}
		return executor.NewResult("sent")
	})
	ex.Handle("oserror", func(context.Context, *executor.Job) (*executor.Result, error) {
		_, err := os.Open(badName)
		return nil, err // a plain error whose text holds the path's 0xff byte
	})
	ex.Handle("typed", func(context.Context, *executor.Job) (*executor.Result, error) {
		return nil, &executor.Error{Code: "BAD\xffCODE\x00", Message: "m\xfe\x00m", NonRetryable: true}
	})
	ex.Handle("panic", func(context.Context, *executor.Job) (*executor.Result, error) {
		panic("bad \xff panic")
	})
	ex.Handle("cancelled", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		<-ctx.Done()
		return nil, errors.New("closing \xff\x00")
	})
	h := executortest.Start(t, ex)
	h.Hello()

	frames := h.Run(job("j1", "progress", ""))
	if len(frames) != 2 || frames[0].GetEvent().GetMessage() != "bad \uFFFD utf8, nul \uFFFD here" ||
		string(frames[1].GetResult().GetOutput()) != `"sent"` {
		t.Fatalf("progress with invalid text: %v", frames)
	}

	frames = h.Run(job("j2", "oserror", ""))
	if e := frames[0].GetError(); e.GetCode() != executor.CodeHandlerError || !e.GetRetryable() ||
		e.GetMessage() != "open "+strings.ToValidUTF8(badName, "\uFFFD")+": no such file or directory" {
		t.Fatalf("a plain error with invalid UTF-8: %v", frames)
	}

	// a code that is not UPPER_SNAKE_CASE (here not even UTF-8) is sent as
	// HANDLER_ERROR naming it, escaped; the message's bad bytes are replaced
	frames = h.Run(job("j3", "typed", ""))
	if e := frames[0].GetError(); e.GetCode() != executor.CodeHandlerError ||
		e.GetMessage() != `error code must be non-empty UPPER_SNAKE_CASE, got "BAD\xffCODE\x00": m`+"\uFFFD\uFFFDm" || e.GetRetryable() {
		t.Fatalf("an *Error with invalid text: %v", frames)
	}

	frames = h.Run(job("j4", "panic", ""))
	if e := frames[0].GetError(); e.GetCode() != executor.CodeHandlerPanic || e.GetMessage() != "the handler panicked: bad \uFFFD panic" {
		t.Fatalf("a panic with invalid text: %v", frames)
	}

	h.SendJob(job("j5", "cancelled", ""))
	h.Started("j5")
	h.Cancel("j5")
	if e := h.JobError("j5", 3, executor.CodeCancelled); !strings.HasSuffix(e.GetMessage(), "; the handler returned: closing \uFFFD\uFFFD") {
		t.Fatalf("a cancelled handler's error with invalid text: %v", e)
	}
}

// An artifact whose name or path is not UTF-8 (a file name the system allows)
// cannot be put in a manifest: ARTIFACT_INVALID, not a terminal that never
// goes out.
func TestArtifactWithInvalidTextIsArtifactInvalid(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("file", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		if err := os.WriteFile(filepath.Join(j.OutputDir, "r\xff.csv"), []byte("x"), 0o644); err != nil {
			return nil, err
		}
		a, err := j.FileArtifact("r\xff.csv", nil)
		if err != nil {
			return nil, err
		}
		return executor.NewResult(1, a)
	})
	for i, a := range []executor.Artifact{
		{Name: "r\xff.csv", Path: "r.csv"},
		{Name: "r.csv", Path: "r\xff.csv"},
		{Name: "r.csv", Path: "r.csv", MediaType: "text/\xff"},
		{Name: "r.csv", Path: "r.csv", DerivedFrom: []string{"in\xff"}},
		{Name: "r.csv", Path: "r\x00.csv"},
	} {
		ex.Handle("manifest"+string(rune('0'+i)), func(context.Context, *executor.Job) (*executor.Result, error) {
			return &executor.Result{Output: []byte("1"), Artifacts: []executor.Artifact{a}}, nil
		})
	}
	h := executortest.Start(t, ex)
	h.Hello()
	fj := job("f", "file", "")
	fj.OutputDir = t.TempDir()
	frames := h.Run(fj)
	if e := frames[0].GetError(); e.GetCode() != executor.CodeArtifactInvalid || e.GetRetryable() || !strings.Contains(e.GetMessage(), "UTF-8") {
		t.Fatalf("FileArtifact of a non-UTF-8 file name: %v", frames)
	}
	for i := range 5 {
		id := "m" + string(rune('0'+i))
		frames := h.Run(job(id, "manifest"+string(rune('0'+i)), ""))
		if e := frames[0].GetError(); e.GetCode() != executor.CodeArtifactInvalid || e.GetRetryable() {
			t.Fatalf("manifest entry %d: %v", i, frames)
		}
	}
	if e := h.Run(job("f2", "manifest4", ""))[0].GetError(); !strings.Contains(e.GetMessage(), "NUL") {
		t.Fatalf("a path with NUL: %v", e)
	}
}
