package main

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/durable-runtime/durable/executors-go/executor"
)

func badInput(format string, args ...any) error {
	return executor.Errorf(executor.CodeBadInput, false, format, args...)
}

// echo: output = input.
func echo(_ context.Context, job *executor.Job) (*executor.Result, error) {
	if len(job.Input) == 0 {
		return &executor.Result{Output: json.RawMessage("null")}, nil
	}
	if !json.Valid(job.Input) {
		return nil, badInput("demo.echo: the input is not valid JSON")
	}
	return &executor.Result{Output: json.RawMessage(job.Input)}, nil
}

const (
	maxSleepMs    = 30 * 24 * 3600 * 1000 // 30 days
	maxSleepSteps = 100_000
)

// sleep: sleeps ms in steps equal slices, one PROGRESS event per slice.
func sleep(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	var in struct {
		Ms    *int64 `json:"ms"`
		Steps *int64 `json:"steps"`
	}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	ms, steps := int64(1000), int64(10)
	if in.Ms != nil {
		ms = *in.Ms
	}
	if in.Steps != nil {
		steps = *in.Steps
	}
	if ms < 0 || ms > maxSleepMs {
		return nil, badInput("demo.sleep: ms = %d, want 0..%d", ms, maxSleepMs)
	}
	if steps < 1 || steps > maxSleepSteps {
		return nil, badInput("demo.sleep: steps = %d, want 1..%d", steps, maxSleepSteps)
	}
	total := time.Duration(ms) * time.Millisecond
	start := time.Now()
	for i := int64(1); i <= steps; i++ {
		// Slice ends are measured from the start, so the slices do not drift.
		end := start.Add(time.Duration(float64(total) * float64(i) / float64(steps)))
		if i == steps {
			end = start.Add(total)
		}
		timer := time.NewTimer(time.Until(end))
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
		if err := job.Progress(fmt.Sprintf("slept %d of %d ms", ms*i/steps, ms), float64(i)/float64(steps)); err != nil {
			return nil, err
		}
	}
	return executor.NewResult(map[string]int64{"slept_ms": ms})
}

// finishOnCancel: waits up to wait_ms (default 30 s) for a cancel and, when it
// arrives, ignores it and finishes at once with {"finished_after_cancel": true}:
// a result after a cancel, which the supervisor keeps when it comes within the
// grace. Without a cancel it ends with {"finished_after_cancel": false}.
func finishOnCancel(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	var in struct {
		WaitMs *int64 `json:"wait_ms"`
	}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	waitMs := int64(30_000)
	if in.WaitMs != nil {
		waitMs = *in.WaitMs
	}
	if waitMs < 0 || waitMs > maxSleepMs {
		return nil, badInput("demo.finish_on_cancel: wait_ms = %d, want 0..%d", waitMs, maxSleepMs)
	}
	// Tells the supervisor (and tests) that the handler is waiting for the cancel.
	if err := job.Progress("demo.finish_on_cancel: waiting for a cancel", executor.NoFraction); err != nil {
		return nil, err
	}
	timer := time.NewTimer(time.Duration(waitMs) * time.Millisecond)
	defer timer.Stop()
	cancelled := false
	select {
	case <-ctx.Done():
		cancelled = true
	case <-timer.C:
	}
	return executor.NewResult(map[string]bool{"finished_after_cancel": cancelled})
}

// fail: fails while attempt <= fail_attempts (every attempt when absent), then
// succeeds with {"attempt": n}.
func fail(_ context.Context, job *executor.Job) (*executor.Result, error) {
	var in struct {
		Code         *string `json:"code"`
		Retryable    *bool   `json:"retryable"`
		FailAttempts *int64  `json:"fail_attempts"`
		Message      *string `json:"message"`
	}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	if in.FailAttempts == nil || int64(job.Attempt) <= *in.FailAttempts {
		e := &executor.Error{
			Code:    "DEMO_FAILURE",
			Message: fmt.Sprintf("demo.fail: failing attempt %d", job.Attempt),
		}
		if in.Code != nil && *in.Code != "" {
			// as the Python demo, whose SDK refuses such a code
			if !upperSnake(*in.Code) {
				return nil, badInput("demo.fail: error code must be non-empty UPPER_SNAKE_CASE, got %q", *in.Code)
			}
			e.Code = *in.Code
		}
		if in.Retryable != nil {
			e.NonRetryable = !*in.Retryable
		}
		if in.Message != nil {
			e.Message = *in.Message
		}
		return nil, e
	}
	return executor.NewResult(map[string]uint32{"attempt": job.Attempt})
}

// upperSnake tells whether code is UPPER_SNAKE_CASE: capital letters,
// digits and underscores.
func upperSnake(code string) bool {
	for _, c := range code {
		if !(c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_') {
			return false
		}
	}
	return code != ""
}

// artifact: writes the input artifacts' bytes (in order) then content repeated
// repeat times to output_dir/name, streaming (a GiB never sits in memory).
// lie ("sha256" or "size", Go demo only) makes the manifest misstate the file,
// for the supervisor's ARTIFACT_DIGEST_MISMATCH check.
func artifact(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	var in struct {
		Name    *string `json:"name"`
		Content string  `json:"content"`
		Repeat  *int64  `json:"repeat"`
		Lie     string  `json:"lie"`
	}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	name, repeat := "artifact.txt", int64(1)
	if in.Name != nil {
		name = *in.Name
	}
	if in.Repeat != nil {
		repeat = *in.Repeat
	}
	if !filepath.IsLocal(name) || slices.Contains(strings.Split(filepath.ToSlash(name), "/"), "..") {
		return nil, badInput("demo.artifact: name %q must be a relative path inside the output directory", name)
	}
	if repeat < 0 {
		return nil, badInput("demo.artifact: repeat = %d, want >= 0", repeat)
	}
	if in.Lie != "" && in.Lie != "sha256" && in.Lie != "size" {
		return nil, badInput("demo.artifact: lie = %q, want \"sha256\", \"size\" or none", in.Lie)
	}
	path, err := job.OutputPath(name)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	derived := make([]string, 0, len(job.InputArtifacts))
	if err := writeArtifact(ctx, path, job.InputArtifacts, in.Content, repeat); err != nil {
		return nil, err
	}
	for _, a := range job.InputArtifacts {
		derived = append(derived, a.ID)
	}
	art, err := job.FileArtifact(name, &executor.ArtifactOptions{Name: name, MediaType: "text/plain", DerivedFrom: derived})
	if err != nil {
		return nil, err
	}
	switch in.Lie {
	case "sha256": // another well-formed digest: the hash of the bytes plus one
		sum := sha256.Sum256([]byte(art.SHA256))
		art.SHA256 = hex.EncodeToString(sum[:])
	case "size":
		art.Size++
	}
	return executor.NewResult(map[string]any{"name": art.Name, "size": art.Size, "sha256": art.SHA256}, art)
}

func writeArtifact(ctx context.Context, path string, inputs []executor.ArtifactRef, content string, repeat int64) (err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := f.Close(); err == nil && cerr != nil {
			err = cerr
		}
	}()
	w := bufio.NewWriterSize(f, 256<<10)
	for _, a := range inputs {
		if err := ctx.Err(); err != nil {
			return err
		}
		src, err := os.Open(a.Path)
		if err != nil {
			return fmt.Errorf("demo.artifact: input artifact %s (%q): %w", a.ID, a.Name, err)
		}
		_, err = io.Copy(w, src)
		src.Close()
		if err != nil {
			return fmt.Errorf("demo.artifact: copying input artifact %s: %w", a.ID, err)
		}
	}
	for i := int64(0); i < repeat; i++ {
		if i%4096 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		if _, err := w.WriteString(content); err != nil {
			return err
		}
	}
	return w.Flush()
}

// effect: a side effect made idempotent by a checkpoint.
func effect(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	var in struct {
		Sink             string `json:"sink"`
		FailAfterEffect  bool   `json:"fail_after_effect"`
		CrashAfterEffect bool   `json:"crash_after_effect"`
	}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	if in.Sink == "" {
		return nil, badInput("demo.effect: sink (a file path) is required")
	}
	marker := "effect-done:" + job.IdempotencyKey
	performed := false
	if !job.HasPreviousCheckpoint || string(job.PreviousCheckpoint) != marker {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := appendLine(in.Sink, job.IdempotencyKey); err != nil {
			return nil, fmt.Errorf("demo.effect: %w", err)
		}
		performed = true
		if err := job.ProgressWithCheckpoint("effect performed", executor.NoFraction, []byte(marker)); err != nil {
			return nil, err
		}
	}
	if job.Attempt == 1 && in.FailAfterEffect {
		return nil, &executor.Error{Code: "EFFECT_FAILED", Message: "demo.effect: failing after the effect"}
	}
	if job.Attempt == 1 && in.CrashAfterEffect {
		fmt.Fprintln(os.Stderr, "demo.effect: crashing after the effect (exit 3)")
		os.Exit(3)
	}
	return executor.NewResult(map[string]bool{"effect_performed": performed})
}

func appendLine(path, line string) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.WriteString(line + "\n"); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// resumeCheckpoint is demo.resume's checkpoint: the next item to process.
type resumeCheckpoint struct {
	Next int64 `json:"next"`
}

// resume: processes items 0..items-1, ms each, checkpointing after every
// item; an attempt resumes at the previous attempt's checkpoint. With a sink
// it appends "<attempt> <item>" per item processed.
func resume(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	in := struct {
		Items int64  `json:"items"`
		Ms    int64  `json:"ms"`
		Sink  string `json:"sink"`
	}{Items: 10, Ms: 100}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	if in.Items < 0 || in.Items > maxSleepSteps || in.Ms < 0 || in.Ms*in.Items > maxSleepMs {
		return nil, badInput("demo.resume: items = %d, ms = %d out of range", in.Items, in.Ms)
	}
	var cp resumeCheckpoint
	if _, err := job.DecodeCheckpoint(&cp); err != nil {
		return nil, err
	}
	start := min(max(cp.Next, 0), in.Items)
	for i := start; i < in.Items; i++ {
		timer := time.NewTimer(time.Duration(in.Ms) * time.Millisecond)
		select {
		case <-ctx.Done():
			timer.Stop()
			return nil, ctx.Err()
		case <-timer.C:
		}
		if in.Sink != "" {
			if err := appendLine(in.Sink, fmt.Sprintf("%d %d", job.Attempt, i)); err != nil {
				return nil, fmt.Errorf("demo.resume: %w", err)
			}
		}
		msg := fmt.Sprintf("item %d of %d done", i+1, in.Items)
		if err := job.ProgressWithCheckpointJSON(msg, float64(i+1)/float64(in.Items), resumeCheckpoint{Next: i + 1}); err != nil {
			return nil, err
		}
	}
	return executor.NewResult(map[string]int64{"started_at": start, "items": in.Items, "attempt": int64(job.Attempt)})
}
