package executortest_test

import (
	"context"
	"testing"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
)

// This file is the README's "Testing a handler" example, run as a test.

type greetIn struct {
	Name string `json:"name"`
}

type greetOut struct {
	Greeting string `json:"greeting"`
}

func greet(_ context.Context, _ *executor.Job, in greetIn) (greetOut, error) {
	return greetOut{Greeting: "hello, " + in.Name}, nil
}

func waitForCancel(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func TestGreet(t *testing.T) {
	ex := executor.New(executor.Options{})
	executor.HandleJSON(ex, "greet", greet)
	ex.Handle("wait", waitForCancel)
	c := executortest.Start(t, ex) // Serve over pipes; the test plays the supervisor
	c.Hello()

	// Run sends the job, checks ACCEPTED and RUNNING, returns what follows.
	frames := c.Run(executortest.NewJob("j1", "greet", `{"name":"Ada"}`))
	if got := string(frames[0].GetResult().GetOutput()); got != `{"greeting":"hello, Ada"}` {
		t.Fatalf("output = %s", got)
	}

	frames = c.Run(executortest.NewJob("j2", "greet", `{"name":7}`))
	if e := frames[0].GetError(); e.GetCode() != executor.CodeBadInput || e.GetRetryable() {
		t.Fatalf("bad input: %v", frames)
	}

	c.SendJob(executortest.NewJob("j3", "wait", ""))
	c.Started("j3")
	c.Cancel("j3")
	c.JobError("j3", 3, executor.CodeCancelled) // sequence 3, after ACCEPTED and RUNNING
}
