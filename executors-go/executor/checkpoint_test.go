package executor_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// The README's resuming step (importRows): without a checkpoint it starts at
// row 0 and checkpoints every row as JSON; handed the checkpoint {"next": 7}
// it imports rows 7..9 only; a checkpoint that is not JSON is BAD_CHECKPOINT.
func TestImportRowsResumes(t *testing.T) {
	ex := newExecutor(executor.Options{})
	ex.Handle("rows.import", importRows)
	h := executortest.Start(t, ex)
	h.Hello()

	checkpoints := func(frames []*pb.ExecutorFrame) []string {
		var out []string
		for _, f := range frames {
			if ev := f.GetEvent(); ev != nil && ev.Checkpoint != nil {
				out = append(out, string(ev.GetCheckpoint()))
			}
		}
		return out
	}
	frames := h.Run(job("j1", "rows.import", ""))
	if got := checkpoints(frames); len(got) != 10 || got[0] != `{"next":1}` || got[9] != `{"next":10}` {
		t.Fatalf("checkpoints of a fresh attempt: %q", got)
	}
	if out := string(frames[len(frames)-1].GetResult().GetOutput()); out != `{"resumed_at":0}` {
		t.Fatalf("fresh output %s", out)
	}

	resumed := job("j2", "rows.import", "")
	resumed.Checkpoint = []byte(`{"next":7}`)
	frames = h.Run(resumed)
	if got := checkpoints(frames); len(got) != 3 || got[0] != `{"next":8}` || got[2] != `{"next":10}` {
		t.Fatalf("checkpoints of the resumed attempt: %q", got)
	}
	if out := string(frames[len(frames)-1].GetResult().GetOutput()); out != `{"resumed_at":7}` {
		t.Fatalf("resumed output %s", out)
	}

	bad := job("j3", "rows.import", "")
	bad.Checkpoint = []byte("7")
	frames = h.Run(bad)
	if e := frames[len(frames)-1].GetError(); e.GetCode() != executor.CodeBadCheckpoint || e.GetRetryable() {
		t.Fatalf("a non-JSON checkpoint: %v", e)
	}
}

func TestDecodeCheckpoint(t *testing.T) {
	var v struct{ N int }
	for _, c := range []struct {
		name    string
		has     bool
		cp      []byte
		ok      bool
		n       int
		errCode string
	}{
		{"absent", false, nil, false, 0, ""},
		{"empty", true, []byte{}, false, 0, ""},
		{"blank", true, []byte(" \n"), false, 0, ""},
		{"json", true, []byte(`{"N": 4}`), true, 4, ""},
		{"not json", true, []byte("\x00\x01"), false, 0, executor.CodeBadCheckpoint},
		{"wrong type", true, []byte(`{"N": "x"}`), false, 0, executor.CodeBadCheckpoint},
	} {
		v.N = 0
		j := &executor.Job{Kind: "k", PreviousCheckpoint: c.cp, HasPreviousCheckpoint: c.has}
		ok, err := j.DecodeCheckpoint(&v)
		var xe *executor.Error
		switch {
		case c.errCode == "" && err != nil, c.errCode != "" && (!errors.As(err, &xe) || xe.Code != c.errCode || !xe.NonRetryable):
			t.Errorf("%s: err %v, want code %q", c.name, err, c.errCode)
		case ok != c.ok || (c.errCode == "" && v.N != c.n):
			t.Errorf("%s: ok %v n %d, want %v %d", c.name, ok, v.N, c.ok, c.n)
		}
	}
}

// A checkpoint comes back inside the next attempt's job frame, beside the
// input: one that would leave that frame over the executor's own cap is
// refused when sent (ErrCheckpointTooLarge, no sequence number used), while
// a smaller one, and the same size when the input leaves room, go out. The
// estimate agrees with the job the supervisor would build next.
func TestACheckpointTheNextAttemptCouldNotReceiveIsRefused(t *testing.T) {
	const limit = 64 << 10
	ex := newExecutor(executor.Options{MaxFrameBytes: limit})
	var refused error
	ex.Handle("cp", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		refused = j.Checkpoint(bytes.Repeat([]byte("c"), 30_000))
		if err := j.Checkpoint(bytes.Repeat([]byte("c"), 20_000)); err != nil {
			return nil, err
		}
		return executor.NewResult("ok")
	})
	h := executortest.Start(t, ex)
	h.Hello()

	input := `{"data":"` + strings.Repeat("i", 40_000) + `"}`
	big := job("j1", "cp", input)
	big.Checkpoint = bytes.Repeat([]byte("o"), 25_000)
	frames := h.Run(big)
	if !errors.Is(refused, executor.ErrCheckpointTooLarge) || !strings.Contains(refused.Error(), "30000 bytes") ||
		!strings.Contains(refused.Error(), "65536") {
		t.Fatalf("a 30,000-byte checkpoint beside a 40,000-byte input: %v", refused)
	}
	var sent []int
	for i, f := range frames {
		s := f.GetEvent().GetSequence()
		if r := f.GetResult(); r != nil {
			s = r.GetSequence()
		}
		if first := frames[0].GetEvent().GetSequence(); s != first+uint64(i) {
			t.Fatalf("frame %d has sequence %d: the refused checkpoint used one", i, s)
		}
		if ev := f.GetEvent(); ev != nil && ev.Checkpoint != nil {
			sent = append(sent, len(ev.GetCheckpoint()))
		}
	}
	if len(sent) != 1 || sent[0] != 20_000 || frames[len(frames)-1].GetResult() == nil {
		t.Fatalf("checkpoints sent %v, last frame %v", sent, frames[len(frames)-1])
	}
	// the estimate is the frame the supervisor would send next
	for _, c := range []struct {
		size int
		fits bool
	}{{20_000, true}, {30_000, false}} {
		next := job("j2", "cp", input)
		next.Attempt = 2
		next.Checkpoint = bytes.Repeat([]byte("c"), c.size)
		n := proto.Size(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: next}})
		if (n <= limit) != c.fits {
			t.Fatalf("the next job with a %d-byte checkpoint is %d bytes: fits %v, want %v", c.size, n, n <= limit, c.fits)
		}
	}

	// with a small input the same 30,000 bytes fit
	refused = nil
	small := job("j3", "cp", `{}`)
	h.Run(small)
	if refused != nil {
		t.Fatalf("a 30,000-byte checkpoint beside a small input: %v", refused)
	}
}

// The next attempt may run on another worker, whose work_dir (or kind of
// process) names its output directory differently: the largest checkpoint
// the SDK accepts still fits a next job whose paths are longer (re-check
// audit: 29 bytes more failed it JOB_TOO_LARGE).
func TestACheckpointLeavesRoomForTheNextAttemptsPaths(t *testing.T) {
	const limit = 64 << 10
	ex := newExecutor(executor.Options{MaxFrameBytes: limit})
	largest := -1
	ex.Handle("cp", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		lo, hi := 0, limit
		for lo < hi { // the largest checkpoint Checkpoint takes (each try that fits is sent)
			mid := (lo + hi + 1) / 2
			if err := j.Checkpoint(make([]byte, mid)); err == nil {
				lo = mid
			} else if errors.Is(err, executor.ErrCheckpointTooLarge) {
				hi = mid - 1
			} else {
				return nil, err
			}
		}
		largest = lo
		return executor.NewResult("ok")
	})
	h := executortest.Start(t, ex)
	h.Hello()
	first := job("j1", "cp", `{"n":1}`)
	first.OutputDir = "/tmp/durable-job-go-abc123"
	h.Run(first)
	if largest <= 0 || largest >= limit-4096 {
		t.Fatalf("largest accepted checkpoint %d", largest)
	}
	next := job("j2", "cp", `{"n":1}`)
	next.Attempt = 2
	next.OutputDir = "/srv/another-worker/" + strings.Repeat("w", 3000) + "/durable-0123456789abcdef-abc123"
	next.Checkpoint = make([]byte, largest)
	if n := proto.Size(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: next}}); n > limit {
		t.Fatalf("the next job with the largest accepted checkpoint (%d) and longer paths is %d bytes, over %d", largest, n, limit)
	}
}
