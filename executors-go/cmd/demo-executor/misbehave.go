package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"sort"
	"strings"
	"syscall"
	"time"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
	"github.com/durable-runtime/durable/executors-go/internal/rawframe"
)

// Sizes the misbehave modes are specified with (PROTOCOL.md).
const (
	garbageLen       = 64
	oversizeAnnounce = 64 << 20 // 64 MiB
	stdoutPrintLines = 1000
	stderrFloodBytes = 50_000_000 // 50 MB
)

// garbageBytes is 0xff followed by text: 64 bytes that are no valid frame.
// 0xff starts a two-byte length prefix announcing far more bytes than follow.
var garbageBytes = func() []byte {
	b := []byte{0xff}
	b = append(b, "this is not a protobuf frame: demo.misbehave mode garbage"...)
	for len(b) < garbageLen {
		b = append(b, '.')
	}
	return b[:garbageLen]
}()

var misbehaviours = map[string]func(ctx context.Context, job *executor.Job) (*executor.Result, error){
	// crash: exit 3 without a terminal.
	"crash": func(context.Context, *executor.Job) (*executor.Result, error) {
		fmt.Fprintln(os.Stderr, "demo.misbehave crash: exiting 3 without a terminal")
		os.Exit(3)
		return nil, nil
	},
	// garbage: 64 bytes that are not a frame. The stream cannot be resynchronised
	// after them, so the process then exits 3: the supervisor sees a truncated
	// frame at end of stream rather than waiting for bytes that never come.
	"garbage": func(_ context.Context, job *executor.Job) (*executor.Result, error) {
		if err := rawframe.Of(job).WriteRaw(garbageBytes); err != nil {
			return nil, err
		}
		os.Exit(3)
		return nil, nil
	},
	// oversize: a length prefix announcing 64 MiB, then some bytes; exit 3 (as garbage).
	"oversize": func(_ context.Context, job *executor.Job) (*executor.Result, error) {
		b := protowire.AppendVarint(nil, oversizeAnnounce)
		b = append(b, bytes.Repeat([]byte{0x2a}, 1024)...)
		if err := rawframe.Of(job).WriteRaw(b); err != nil {
			return nil, err
		}
		os.Exit(3)
		return nil, nil
	},
	// backwards: PROGRESS sequence 5, then PROGRESS sequence 3; then wait to be cancelled.
	"backwards": func(ctx context.Context, job *executor.Job) (*executor.Result, error) {
		for _, seq := range []uint64{5, 3} {
			if err := rawframe.Of(job).SendFrame(progressFrame(job, seq, fmt.Sprintf("demo.misbehave backwards: sequence %d", seq))); err != nil {
				return nil, err
			}
		}
		<-ctx.Done()
		return nil, ctx.Err()
	},
	// after_terminal: a JobResult, then a PROGRESS event; then wait to be
	// cancelled. The JobResult counts as the terminal: no CANCELLED follows.
	"after_terminal": func(ctx context.Context, job *executor.Job) (*executor.Result, error) {
		result := &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Result{Result: &pb.JobResult{
			JobId: job.ID, Sequence: 3, Output: []byte(`{"mode":"after_terminal"}`),
		}}}
		if err := rawframe.Of(job).SendFrame(result); err != nil {
			return nil, err
		}
		if err := rawframe.Of(job).SendFrame(progressFrame(job, 4, "demo.misbehave after_terminal: an event after the terminal")); err != nil {
			return nil, err
		}
		<-ctx.Done()
		return nil, ctx.Err()
	},
	// hang: no further frame; only a cancel (or stdin closing) ends it.
	"hang": func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	},
	// ignore_cancel: a SIGTERM handler that does nothing, then sleep forever,
	// whatever the context says. One PROGRESS event tells that the handler is
	// installed.
	"ignore_cancel": func(_ context.Context, job *executor.Job) (*executor.Result, error) {
		sigs := make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM)
		go func() {
			for range sigs {
				fmt.Fprintln(os.Stderr, "demo.misbehave ignore_cancel: ignoring SIGTERM")
			}
		}()
		if err := job.Progress("demo.misbehave ignore_cancel: ignoring cancel and SIGTERM", executor.NoFraction); err != nil {
			return nil, err
		}
		for {
			time.Sleep(time.Hour)
		}
	},
	// grandchild: start `sleep 300` in this process group and return at once.
	// The child shares stdout (now stderr) and stderr, as an inheriting child
	// would, so it also holds the supervisor's stderr pipe open.
	"grandchild": func(_ context.Context, _ *executor.Job) (*executor.Result, error) {
		cmd := exec.Command("sleep", "300")
		cmd.Stdout = os.Stdout
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			return nil, fmt.Errorf("demo.misbehave grandchild: starting sleep: %w", err)
		}
		return executor.NewResult(map[string]int{"grandchild_pid": cmd.Process.Pid})
	},
	// stdout_print: 1000 lines to stdout, alternately through fmt.Println and
	// straight to fd 1 (as a child process would), then succeed.
	"stdout_print": func(_ context.Context, _ *executor.Job) (*executor.Result, error) {
		for i := 1; i <= stdoutPrintLines; i++ {
			line := fmt.Sprintf("demo.misbehave stdout_print: line %d of %d", i, stdoutPrintLines)
			if i%2 == 1 {
				fmt.Println(line)
			} else if _, err := syscall.Write(1, []byte(line+"\n")); err != nil {
				return nil, fmt.Errorf("demo.misbehave stdout_print: %w", err)
			}
		}
		return executor.NewResult(map[string]int{"lines_printed": stdoutPrintLines})
	},
	// stderr_flood: 50 MB to stderr, then succeed.
	"stderr_flood": func(ctx context.Context, _ *executor.Job) (*executor.Result, error) {
		line := []byte(strings.Repeat("demo.misbehave stderr_flood ", 3) + "\n")
		chunk := bytes.Repeat(line, (64<<10)/len(line))
		for left := stderrFloodBytes; left > 0; {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			n := min(left, len(chunk))
			if _, err := os.Stderr.Write(chunk[:n]); err != nil {
				return nil, fmt.Errorf("demo.misbehave stderr_flood: %w", err)
			}
			left -= n
		}
		return executor.NewResult(map[string]int{"stderr_bytes": stderrFloodBytes})
	},
}

// misbehave breaks the protocol on purpose, in the way input.mode names.
func misbehave(ctx context.Context, job *executor.Job) (*executor.Result, error) {
	var in struct {
		Mode string `json:"mode"`
	}
	if err := job.DecodeInput(&in); err != nil {
		return nil, err
	}
	f := misbehaviours[in.Mode]
	if f == nil {
		modes := make([]string, 0, len(misbehaviours))
		for m := range misbehaviours {
			modes = append(modes, m)
		}
		sort.Strings(modes)
		return nil, badInput("demo.misbehave: unknown mode %q (modes: %s)", in.Mode, strings.Join(modes, ", "))
	}
	return f(ctx, job)
}

func progressFrame(job *executor.Job, seq uint64, message string) *pb.ExecutorFrame {
	return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Event{Event: &pb.ProgressEvent{
		JobId:    job.ID,
		Sequence: seq,
		Kind:     pb.EventKind_EVENT_KIND_PROGRESS,
		Message:  message,
		AtUnixMs: time.Now().UnixMilli(),
	}}}
}
