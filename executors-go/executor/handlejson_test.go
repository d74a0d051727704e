package executor_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
)

type greetIn struct {
	Name  string `json:"name"`
	Times int    `json:"times"`
}

type greetOut struct {
	Greeting string `json:"greeting"`
}

func TestHandleJSON(t *testing.T) {
	ex := newExecutor(executor.Options{})
	executor.HandleJSON(ex, "greet", func(_ context.Context, _ *executor.Job, in greetIn) (greetOut, error) {
		if in.Name == "" {
			in.Name = "nobody"
		}
		return greetOut{Greeting: strings.Repeat("hello "+in.Name+"! ", max(in.Times, 1))}, nil
	})
	executor.HandleJSON(ex, "unencodable", func(context.Context, *executor.Job, struct{}) (chan int, error) {
		return make(chan int), nil
	})
	executor.HandleJSON(ex, "fails", func(context.Context, *executor.Job, struct{}) (*greetOut, error) {
		return nil, &executor.Error{Code: "NOPE", Message: "no"}
	})
	executor.HandleJSON(ex, "with-artifact", func(_ context.Context, j *executor.Job, in greetIn) (*executor.Result, error) {
		if err := os.WriteFile(filepath.Join(j.OutputDir, "greeting.txt"), []byte("hello "+in.Name), 0o644); err != nil {
			return nil, err
		}
		a, err := j.FileArtifact("greeting.txt", &executor.ArtifactOptions{MediaType: "text/plain"})
		if err != nil {
			return nil, err
		}
		return executor.NewResult(map[string]string{"wrote": a.Path}, a)
	})
	c := executortest.Start(t, ex)
	c.Hello()

	frames := c.Run(job("j1", "greet", `{"name":"Ada","times":2}`))
	if got := string(frames[0].GetResult().GetOutput()); got != `{"greeting":"hello Ada! hello Ada! "}` {
		t.Fatalf("output = %s", got)
	}
	// Empty input and null: the zero In.
	for _, in := range []string{"", "null"} {
		frames = c.Run(job("j2", "greet", in))
		if got := string(frames[0].GetResult().GetOutput()); got != `{"greeting":"hello nobody! "}` {
			t.Fatalf("input %q: output = %s", in, got)
		}
	}
	// Input that does not decode: BAD_INPUT after ACCEPTED and RUNNING (Run
	// checked them), not retryable.
	for _, in := range []string{`{"name":7}`, `[1]`, `{not json`} {
		frames = c.Run(job("j3", "greet", in))
		if e := frames[0].GetError(); e.GetCode() != executor.CodeBadInput || e.GetRetryable() || e.GetSequence() != 3 || !strings.Contains(e.GetMessage(), `"greet"`) {
			t.Fatalf("input %s: frames = %v", in, frames)
		}
	}
	frames = c.Run(job("j4", "unencodable", ""))
	if e := frames[0].GetError(); e.GetCode() != executor.CodeOutputInvalid || e.GetRetryable() {
		t.Fatalf("unencodable output: %v", frames)
	}
	frames = c.Run(job("j5", "fails", ""))
	if e := frames[0].GetError(); e.GetCode() != "NOPE" || !e.GetRetryable() {
		t.Fatalf("failing handler: %v", frames)
	}
	pj := job("j6", "with-artifact", `{"name":"Ada"}`)
	pj.OutputDir = t.TempDir()
	frames = c.Run(pj)
	r := frames[0].GetResult()
	if string(r.GetOutput()) != `{"wrote":"greeting.txt"}` || len(r.GetArtifacts()) != 1 || r.GetArtifacts()[0].GetSize() != 9 || r.GetArtifacts()[0].GetMediaType() != "text/plain" {
		t.Fatalf("result with an artifact: %v", frames)
	}
}

func TestHandleJSONMisuse(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Error("HandleJSON with a nil function did not panic")
		}
	}()
	executor.HandleJSON[struct{}, struct{}](newExecutor(executor.Options{}), "k", nil)
}
