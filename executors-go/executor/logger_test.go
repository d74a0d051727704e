package executor_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
)

// syncBuffer is a bytes.Buffer safe for the handler goroutine and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestJobLogger(t *testing.T) {
	var out syncBuffer
	ex := executor.New(executor.Options{Logger: slog.New(slog.NewJSONHandler(&out, nil))})
	ex.Handle("k", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		tok := j.Secrets["TOKEN"]
		j.Logger().Info("calling with "+tok, "token", tok, "err", errors.New("rejected "+tok), slog.Group("g", "t", tok), "n", 3)
		j.Logger().WithGroup("sub").With("pre", tok).Warn("second")
		return nil, nil
	})
	c := executortest.Start(t, ex)
	c.Hello()
	pj := job("j7", "k", "")
	pj.Attempt = 3
	pj.Secrets = map[string]string{"TOKEN": "s3cr3t-value"}
	c.Run(pj)

	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if strings.Contains(out.String(), "s3cr3t") || len(lines) != 2 {
		t.Fatalf("log:\n%s", out.String())
	}
	var rec map[string]any
	if err := json.Unmarshal([]byte(lines[0]), &rec); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"level": "INFO", "msg": "calling with [REDACTED]", "job_id": "j7", "kind": "k", "attempt": 3.0,
		"token": "[REDACTED]", "err": "rejected [REDACTED]", "g": map[string]any{"t": "[REDACTED]"}, "n": 3.0}
	for k, v := range want {
		if g, _ := json.Marshal(rec[k]); string(g) != string(must(json.Marshal(v))) {
			t.Errorf("%s = %s, want %v (record %s)", k, g, v, lines[0])
		}
	}
	if !strings.Contains(lines[1], `"sub":{"pre":"[REDACTED]"}`) {
		t.Errorf("second record: %s", lines[1])
	}

	// A Job built by hand (a unit test of a handler) still has a logger.
	(&executor.Job{ID: "x"}).Logger().Debug("fine")
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
