package executor_test

import (
	"errors"
	"testing"

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
