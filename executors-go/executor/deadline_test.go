package executor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// deadlineOf runs one job and returns the deadline its handler's context had.
func deadlineOf(t *testing.T, opts executor.Options, pj *pb.Job) (time.Time, bool) {
	t.Helper()
	type seen struct {
		d  time.Time
		ok bool
	}
	got := make(chan seen, 1)
	ex := newExecutor(opts)
	ex.Handle("k", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		d, ok := ctx.Deadline()
		got <- seen{d, ok}
		return nil, nil
	})
	c := executortest.Start(t, ex)
	c.Hello()
	c.Run(pj)
	s := <-got
	return s.d, s.ok
}

func near(t *testing.T, what string, got, want time.Time) {
	t.Helper()
	if d := got.Sub(want); d < -20*time.Millisecond || d > 20*time.Millisecond {
		t.Errorf("%s = %s, want %s (±20ms; off by %s)", what, got.Format(time.RFC3339Nano), want.Format(time.RFC3339Nano), d)
	}
}

func TestContextCarriesTheJobsDeadlineMinusSlack(t *testing.T) {
	now := time.Now()
	at := func(d time.Duration) int64 { return now.Add(d).UnixMilli() }
	ms := func(v int64) time.Time { return time.UnixMilli(v) }

	// The earlier of the two deadlines, minus the default slack of 1 s.
	pj := job("j", "k", "")
	pj.AttemptDeadlineUnixMs, pj.DeadlineUnixMs = at(time.Minute), at(30*time.Second)
	d, ok := deadlineOf(t, executor.Options{}, pj)
	if !ok {
		t.Fatal("the context has no deadline")
	}
	near(t, "deadline (step deadline first)", d, ms(pj.DeadlineUnixMs).Add(-executor.DefaultDeadlineSlack))

	pj.AttemptDeadlineUnixMs, pj.DeadlineUnixMs = at(20*time.Second), 0
	d, _ = deadlineOf(t, executor.Options{}, pj)
	near(t, "deadline (attempt deadline only)", d, ms(pj.AttemptDeadlineUnixMs).Add(-time.Second))

	// A custom slack.
	d, _ = deadlineOf(t, executor.Options{DeadlineSlack: 50 * time.Millisecond}, pj)
	near(t, "deadline (slack 50ms)", d, ms(pj.AttemptDeadlineUnixMs).Add(-50*time.Millisecond))

	// A short attempt: the slack is at most a tenth of the time left.
	pj.AttemptDeadlineUnixMs = at(2 * time.Second)
	d, _ = deadlineOf(t, executor.Options{}, pj)
	near(t, "deadline (2s left)", d, ms(pj.AttemptDeadlineUnixMs).Add(-200*time.Millisecond))

	// No deadline in the job, or NoDeadline: none in the context.
	pj.AttemptDeadlineUnixMs = 0
	if d, ok := deadlineOf(t, executor.Options{}, pj); ok {
		t.Errorf("a job without deadlines: the context's deadline is %s", d)
	}
	pj.AttemptDeadlineUnixMs = at(time.Minute)
	if d, ok := deadlineOf(t, executor.Options{NoDeadline: true}, pj); ok {
		t.Errorf("NoDeadline: the context's deadline is %s", d)
	}
}

// A handler that runs into its deadline returns before the supervisor's own
// timeout, and the SDK reports HANDLER_TIMEOUT, retryable.
func TestHandlerTimeout(t *testing.T) {
	blockedUntilDeadline := func(ctx context.Context) error {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(waitTimeout):
			return errors.New("the context never expired")
		}
	}
	cases := []struct {
		name     string
		handler  func(ctx context.Context) error
		deadline bool   // the job has an attempt deadline
		code     string // the terminal's code
		message  string
	}{
		{"ctx.Err", blockedUntilDeadline, true, executor.CodeHandlerTimeout, "the handler ran out of time"},
		{"wrapped", func(ctx context.Context) error {
			return fmt.Errorf("fetching: %w", blockedUntilDeadline(ctx))
		}, true, executor.CodeHandlerTimeout, "it returned: fetching: context deadline exceeded"},
		{"plain error after the deadline", func(ctx context.Context) error {
			_ = blockedUntilDeadline(ctx)
			return errors.New("signal: killed")
		}, true, executor.CodeHandlerTimeout, "it returned: signal: killed"},
		{"typed error after the deadline keeps its code", func(ctx context.Context) error {
			_ = blockedUntilDeadline(ctx)
			return &executor.Error{Code: "MINE", Message: "gave up"}
		}, true, "MINE", "gave up"},
		{"a deadline of the handler's own", func(ctx context.Context) error {
			ctx, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
			defer cancel()
			return blockedUntilDeadline(ctx)
		}, false, executor.CodeHandlerTimeout, "context deadline exceeded"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ex := newExecutor(executor.Options{DeadlineSlack: 100 * time.Millisecond})
			ex.Handle("k", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
				return nil, tc.handler(ctx)
			})
			c := executortest.Start(t, ex)
			c.Hello()
			pj := job("j", "k", "")
			var jobDeadline time.Time
			if tc.deadline {
				jobDeadline = time.Now().Add(300 * time.Millisecond)
				pj.AttemptDeadlineUnixMs = jobDeadline.UnixMilli()
			}
			c.SendJob(pj)
			c.Started("j")
			e := c.JobError("j", 3, tc.code)
			if tc.deadline && !time.Now().Before(jobDeadline) {
				t.Errorf("the terminal arrived %s after the job's deadline", time.Since(jobDeadline))
			}
			if !e.GetRetryable() || !strings.Contains(e.GetMessage(), tc.message) {
				t.Fatalf("terminal = %v, want retryable with %q in the message", e, tc.message)
			}
			if tc.code == executor.CodeHandlerTimeout && tc.deadline && !strings.Contains(string(e.GetDetails()), `"context_deadline_unix_ms":`) {
				t.Errorf("details = %s", e.GetDetails())
			}
		})
	}
}

// Running out of the step's deadline (not the attempt's) is not retryable:
// no attempt may run past it, and a retry started within the slack only ran
// out again.
func TestRunningOutOfTheStepsDeadlineIsNotRetryable(t *testing.T) {
	for _, tc := range []struct {
		name      string
		attempt   time.Duration // 0: none
		step      time.Duration
		retryable bool
	}{
		{"the step's deadline alone", 0, 300 * time.Millisecond, false},
		{"the step's before the attempt's", 900 * time.Millisecond, 300 * time.Millisecond, false},
		{"the attempt's before the step's", 300 * time.Millisecond, time.Hour, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ex := newExecutor(executor.Options{DeadlineSlack: 100 * time.Millisecond})
			ex.Handle("k", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
				<-ctx.Done()
				return nil, fmt.Errorf("gave up: %w", errors.New("plain"))
			})
			c := executortest.Start(t, ex)
			c.Hello()
			pj := job("j", "k", "")
			pj.DeadlineUnixMs = time.Now().Add(tc.step).UnixMilli()
			if tc.attempt > 0 {
				pj.AttemptDeadlineUnixMs = time.Now().Add(tc.attempt).UnixMilli()
			}
			c.SendJob(pj)
			c.Started("j")
			e := c.JobError("j", 3, executor.CodeHandlerTimeout)
			if e.GetRetryable() != tc.retryable {
				t.Fatalf("terminal = %v, want retryable %v", e, tc.retryable)
			}
			if !tc.retryable && !strings.Contains(e.GetMessage(), "the step's deadline, after which no attempt may run") {
				t.Fatalf("message = %q", e.GetMessage())
			}
		})
	}
}

// A cancel is a cancel also when the context has a deadline.
func TestCancelBeforeTheDeadlineIsCancelled(t *testing.T) {
	started := make(chan struct{})
	ex := newExecutor(executor.Options{})
	ex.Handle("k", func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		close(started)
		<-ctx.Done()
		return nil, ctx.Err()
	})
	c := executortest.Start(t, ex)
	c.Hello()
	pj := job("j", "k", "")
	pj.AttemptDeadlineUnixMs = time.Now().Add(time.Minute).UnixMilli()
	c.SendJob(pj)
	c.Started("j")
	waitClosed(t, started, "handler start")
	c.Cancel("j")
	if e := c.JobError("j", 3, executor.CodeCancelled); e.GetRetryable() {
		t.Fatalf("terminal = %v", e)
	}
}
