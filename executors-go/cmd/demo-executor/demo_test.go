package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

var allDemoKinds = []string{"demo.artifact", "demo.echo", "demo.effect", "demo.fail", "demo.finish_on_cancel", "demo.misbehave", "demo.resume", "demo.sleep"}

func jsonEqual(t *testing.T, what string, got []byte, want string) {
	t.Helper()
	var g, w any
	if err := json.Unmarshal(got, &g); err != nil {
		t.Fatalf("%s: %q is not JSON: %v", what, got, err)
	}
	if err := json.Unmarshal([]byte(want), &w); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(g, w) {
		t.Fatalf("%s = %s, want %s", what, got, want)
	}
}

func TestHello(t *testing.T) {
	d := startDemo(t, "DEMO_LABELS=gpu=a100, region = eu ,,")
	h := d.Hello()
	want := &pb.Hello{
		ProtocolVersion:   pb.ProtocolVersion_PROTOCOL_VERSION_1,
		ExecutorKind:      "go",
		Kinds:             allDemoKinds,
		Labels:            map[string]string{"gpu": "a100", "region": "eu"},
		SdkName:           "durable-executor-go",
		SdkVersion:        executor.Version(),
		MaxJobsPerProcess: -1,
		Pid:               uint32(d.cmd.Process.Pid),
		ProtocolVersions:  []string{"1.0", "1.1"},
		Features:          []string{"frame_limits"},
		MaxFrameBytes:     executor.DefaultMaxFrameBytes,
	}
	if !proto.Equal(h, want) {
		t.Fatalf("hello:\n got %v\nwant %v", h, want)
	}
	d.closeAndExpectExit()
}

func TestShutdownWhenIdleExitsZero(t *testing.T) {
	d := startDemo(t)
	d.Hello()
	d.Send(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Shutdown{Shutdown: &pb.Shutdown{Reason: "test"}}})
	if code := d.wait(); code != 0 {
		t.Fatalf("exit status %d after Shutdown", code)
	}
}

func TestDemoKindsRestrictsHelloAndRefusesOthers(t *testing.T) {
	d := startDemo(t, "DEMO_KINDS=demo.fail, demo.echo")
	if got := d.Hello().GetKinds(); !slices.Equal(got, []string{"demo.echo", "demo.fail"}) {
		t.Fatalf("kinds = %v", got)
	}
	d.SendJob(newJob("j1", "demo.sleep", `{}`))
	d.JobError("j1", 1, executor.CodeUnsupportedKind)
	d.SendJob(newJob("j2", "demo.echo", `7`))
	d.Started("j2")
	d.Result("j2", 3)
	d.closeAndExpectExit()
}

func TestBadEnvironmentExitsTwo(t *testing.T) {
	for _, env := range []string{"DEMO_LABELS=novalue", "DEMO_LABELS=a=1,a=2", "DEMO_KINDS=demo.echo,demo.nope"} {
		d := startDemo(t, env)
		if code := d.wait(); code != 2 {
			t.Errorf("%s: exit status %d, want 2", env, code)
		}
		if !strings.Contains(d.stderr.String(), strings.SplitN(env, "=", 2)[0]) {
			t.Errorf("%s: stderr %q does not name the variable", env, d.stderr.String())
		}
	}
}

func TestEcho(t *testing.T) {
	input := `{"a":[1,2.5,{"b":null}],"s":"héllo"}`
	frames := runOne(t, newJob("j", "demo.echo", input))
	if len(frames) != 1 || string(frames[0].GetResult().GetOutput()) != input {
		t.Fatalf("frames = %v", frames)
	}
	frames = runOne(t, newJob("j", "demo.echo", `{not json`))
	if e := frames[0].GetError(); e.GetCode() != executor.CodeBadInput || e.GetRetryable() {
		t.Fatalf("invalid JSON input: %v", frames)
	}
}

func TestSleepReportsProgressPerSlice(t *testing.T) {
	start := time.Now()
	frames := runOne(t, newJob("j", "demo.sleep", `{"ms":200,"steps":4}`))
	if elapsed := time.Since(start); elapsed < 200*time.Millisecond {
		t.Fatalf("demo.sleep of 200 ms took %s", elapsed)
	}
	if len(frames) != 5 {
		t.Fatalf("frames = %v", frames)
	}
	for i, want := range []float64{0.25, 0.5, 0.75, 1} {
		ev := frames[i].GetEvent()
		if ev.GetKind() != pb.EventKind_EVENT_KIND_PROGRESS || ev.GetSequence() != uint64(3+i) || ev.Fraction == nil || *ev.Fraction != want {
			t.Fatalf("event %d = %v, want PROGRESS seq %d fraction %v", i, ev, 3+i, want)
		}
	}
	r := frames[4].GetResult()
	if r.GetSequence() != 7 {
		t.Fatalf("result = %v", r)
	}
	jsonEqual(t, "output", r.GetOutput(), `{"slept_ms":200}`)
}

// The demos leave deadlines to the supervisor (Options.NoDeadline): a
// demo.sleep past its attempt deadline keeps sleeping until the supervisor
// cancels it, so that the attempt ends with the supervisor's ATTEMPT_TIMEOUT,
// not with the SDK's HANDLER_TIMEOUT.
func TestDemoLeavesDeadlinesToTheSupervisor(t *testing.T) {
	j := newJob("j", "demo.sleep", `{"ms":300,"steps":1}`)
	j.AttemptDeadlineUnixMs = time.Now().Add(50 * time.Millisecond).UnixMilli()
	j.DeadlineUnixMs = j.AttemptDeadlineUnixMs
	frames := runOne(t, j)
	if len(frames) != 2 || frames[1].GetResult() == nil {
		t.Fatalf("frames = %v, want one PROGRESS event and a result", frames)
	}
}

func TestSleepHonoursCancelWithin100ms(t *testing.T) {
	d := startDemo(t)
	d.Hello()
	d.SendJob(newJob("j", "demo.sleep", `{"ms":60000,"steps":10}`))
	d.Started("j")
	time.Sleep(20 * time.Millisecond) // well inside the first 6 s slice
	sent := time.Now()
	d.Cancel("j")
	e := d.JobError("j", 3, executor.CodeCancelled)
	if took := time.Since(sent); took > 100*time.Millisecond {
		t.Fatalf("demo.sleep took %s to answer a cancel, want < 100ms", took)
	}
	if e.GetRetryable() {
		t.Fatalf("CANCELLED is retryable: %v", e)
	}
	d.closeAndExpectExit()
}

// demo.finish_on_cancel answers a cancel with a result, promptly (well within
// the grace): the terminal reflects what the handler did.
func TestFinishOnCancelReturnsAResultAfterTheCancel(t *testing.T) {
	d := startDemo(t)
	d.Hello()
	d.SendJob(newJob("j", "demo.finish_on_cancel", `{}`))
	d.Started("j")
	if ev := d.Event("j", 3, pb.EventKind_EVENT_KIND_PROGRESS); !strings.Contains(ev.GetMessage(), "waiting for a cancel") {
		t.Fatalf("event = %v", ev)
	}
	sent := time.Now()
	d.Cancel("j")
	r := d.Result("j", 4)
	if took := time.Since(sent); took > 100*time.Millisecond {
		t.Fatalf("demo.finish_on_cancel took %s to answer a cancel, want < 100ms", took)
	}
	jsonEqual(t, "output", r.GetOutput(), `{"finished_after_cancel":true}`)
	d.closeAndExpectExit()
}

func TestFinishOnCancelWithoutACancel(t *testing.T) {
	frames := runOne(t, newJob("j", "demo.finish_on_cancel", `{"wait_ms":50}`))
	if len(frames) != 2 || frames[0].GetEvent().GetKind() != pb.EventKind_EVENT_KIND_PROGRESS {
		t.Fatalf("frames = %v", frames)
	}
	jsonEqual(t, "output", frames[1].GetResult().GetOutput(), `{"finished_after_cancel":false}`)
	for _, in := range []string{`{"wait_ms":-1}`, `{"wait_ms":"soon"}`, `[1]`} {
		frames := runOne(t, newJob("j", "demo.finish_on_cancel", in))
		if e := frames[0].GetError(); e.GetCode() != executor.CodeBadInput || e.GetRetryable() {
			t.Errorf("input %s: %v", in, frames)
		}
	}
}

func TestSleepRejectsBadInput(t *testing.T) {
	for _, in := range []string{`{"steps":0}`, `{"ms":-1}`, `{"ms":"soon"}`, `[1]`} {
		frames := runOne(t, newJob("j", "demo.sleep", in))
		if e := frames[0].GetError(); e.GetCode() != executor.CodeBadInput || e.GetRetryable() {
			t.Errorf("input %s: %v", in, frames)
		}
	}
}

func TestFail(t *testing.T) {
	cases := []struct {
		name    string
		input   string
		attempt uint32
		code    string // "" = success
		retry   bool
		message string
		output  string
	}{
		{"defaults fail every attempt", `{}`, 7, "DEMO_FAILURE", true, "demo.fail: failing attempt 7", ""},
		{"custom failure", `{"code":"NOPE","retryable":false,"fail_attempts":2,"message":"no way"}`, 2, "NOPE", false, "no way", ""},
		{"succeeds after fail_attempts", `{"code":"NOPE","fail_attempts":2}`, 3, "", false, "", `{"attempt":3}`},
		{"fail_attempts 0 never fails", `{"fail_attempts":0}`, 1, "", false, "", `{"attempt":1}`},
		// as the Python demo: a code that is not UPPER_SNAKE_CASE is bad input
		{"a code that is not one", `{"code":"Bad Input","retryable":true}`, 1, "BAD_INPUT", false,
			`demo.fail: error code must be non-empty UPPER_SNAKE_CASE, got "Bad Input"`, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			j := newJob("j", "demo.fail", c.input)
			j.Attempt = c.attempt
			frames := runOne(t, j)
			if c.code == "" {
				jsonEqual(t, "output", frames[0].GetResult().GetOutput(), c.output)
				return
			}
			e := frames[0].GetError()
			if e.GetCode() != c.code || e.GetRetryable() != c.retry || e.GetMessage() != c.message || e.GetSequence() != 3 {
				t.Fatalf("error = %v", e)
			}
		})
	}
}

func TestArtifact(t *testing.T) {
	in := t.TempDir()
	for name, content := range map[string]string{"one.txt": "first input\n", "two.txt": "second input\n"} {
		if err := os.WriteFile(filepath.Join(in, name), []byte(content), 0o444); err != nil {
			t.Fatal(err)
		}
	}
	out := t.TempDir()
	j := newJob("j", "demo.artifact", `{"name":"sub/result.txt","content":"ab","repeat":3}`)
	j.OutputDir = out
	j.InputArtifacts = []*pb.ArtifactRef{
		{Id: "art-1", Name: "one", Path: filepath.Join(in, "one.txt"), MediaType: "text/plain"},
		{Id: "art-2", Name: "two", Path: filepath.Join(in, "two.txt"), MediaType: "text/plain"},
	}
	frames := runOne(t, j)
	r := frames[0].GetResult()
	if r == nil {
		t.Fatalf("frames = %v", frames)
	}
	wantBytes := "first input\nsecond input\nababab"
	got, err := os.ReadFile(filepath.Join(out, "sub", "result.txt"))
	if err != nil || string(got) != wantBytes {
		t.Fatalf("artifact file = %q, %v; want %q", got, err, wantBytes)
	}
	sum := sha256.Sum256([]byte(wantBytes))
	hexSum := hex.EncodeToString(sum[:])
	wantEntry := &pb.ArtifactManifestEntry{Name: "sub/result.txt", Path: "sub/result.txt", Sha256: hexSum,
		Size: uint64(len(wantBytes)), MediaType: "text/plain", DerivedFrom: []string{"art-1", "art-2"}}
	if len(r.GetArtifacts()) != 1 || !proto.Equal(r.GetArtifacts()[0], wantEntry) {
		t.Fatalf("manifest = %v, want %v", r.GetArtifacts(), wantEntry)
	}
	jsonEqual(t, "output", r.GetOutput(), `{"name":"sub/result.txt","size":`+itoa(len(wantBytes))+`,"sha256":"`+hexSum+`"}`)

	// Defaults, no inputs.
	out2 := t.TempDir()
	j = newJob("j", "demo.artifact", `{"content":"hi"}`)
	j.OutputDir = out2
	r = runOne(t, j)[0].GetResult()
	if got, _ := os.ReadFile(filepath.Join(out2, "artifact.txt")); string(got) != "hi" || r.GetArtifacts()[0].GetPath() != "artifact.txt" ||
		len(r.GetArtifacts()[0].GetDerivedFrom()) != 0 {
		t.Fatalf("default artifact: file %q, result %v", got, r)
	}

	// A name escaping the output directory is bad input.
	j = newJob("j", "demo.artifact", `{"name":"../x.txt"}`)
	j.OutputDir = t.TempDir()
	if e := runOne(t, j)[0].GetError(); e.GetCode() != executor.CodeBadInput {
		t.Fatalf("escaping name: %v", e)
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

func readLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}

func TestEffectIsNotRepeatedWithItsCheckpoint(t *testing.T) {
	sink := filepath.Join(t.TempDir(), "sink.txt")
	input := `{"sink":` + string(mustJSON(sink)) + `,"fail_after_effect":true}`

	// Attempt 1: performs the effect, checkpoints it, then fails.
	j := newJob("a1", "demo.effect", input)
	j.IdempotencyKey = "step-key"
	frames := runOne(t, j)
	if len(frames) != 2 {
		t.Fatalf("attempt 1 frames = %v", frames)
	}
	ev := frames[0].GetEvent()
	if ev.GetKind() != pb.EventKind_EVENT_KIND_PROGRESS || ev.GetSequence() != 3 || string(ev.GetCheckpoint()) != "effect-done:step-key" {
		t.Fatalf("attempt 1 event = %v", ev)
	}
	if e := frames[1].GetError(); e.GetCode() != "EFFECT_FAILED" || !e.GetRetryable() || e.GetSequence() != 4 {
		t.Fatalf("attempt 1 terminal = %v", frames[1])
	}
	if lines := readLines(t, sink); !slices.Equal(lines, []string{"step-key"}) {
		t.Fatalf("sink after attempt 1 = %q", lines)
	}

	// Attempt 2 with attempt 1's checkpoint: skips the effect and succeeds.
	j = newJob("a2", "demo.effect", input)
	j.IdempotencyKey, j.Attempt, j.Checkpoint = "step-key", 2, ev.GetCheckpoint()
	frames = runOne(t, j)
	if len(frames) != 1 {
		t.Fatalf("attempt 2 frames = %v", frames)
	}
	jsonEqual(t, "attempt 2 output", frames[0].GetResult().GetOutput(), `{"effect_performed":false}`)
	if lines := readLines(t, sink); !slices.Equal(lines, []string{"step-key"}) {
		t.Fatalf("sink after attempt 2 = %q: the effect was repeated", lines)
	}

	// Without the checkpoint, attempt 2 would repeat it (the checkpoint is what prevents it).
	j = newJob("a3", "demo.effect", input)
	j.IdempotencyKey, j.Attempt = "step-key", 2
	frames = runOne(t, j)
	jsonEqual(t, "attempt without checkpoint", frames[1].GetResult().GetOutput(), `{"effect_performed":true}`)
	if lines := readLines(t, sink); len(lines) != 2 {
		t.Fatalf("sink = %q", lines)
	}
}

func TestEffectCrashAfterEffect(t *testing.T) {
	sink := filepath.Join(t.TempDir(), "sink.txt")
	d := startDemo(t)
	d.Hello()
	j := newJob("j", "demo.effect", `{"sink":`+string(mustJSON(sink))+`,"crash_after_effect":true}`)
	d.SendJob(j)
	d.Started("j")
	if ev := d.Event("j", 3, pb.EventKind_EVENT_KIND_PROGRESS); string(ev.GetCheckpoint()) != "effect-done:idem-j" {
		t.Fatalf("event = %v", ev)
	}
	if err := d.EndOfStream(); err.Error() != "EOF" {
		t.Fatalf("stdout after the crash: %v, want a clean EOF with no terminal", err)
	}
	if code := d.wait(); code != 3 {
		t.Fatalf("exit status %d, want 3", code)
	}
	if lines := readLines(t, sink); !slices.Equal(lines, []string{"idem-j"}) {
		t.Fatalf("sink = %q", lines)
	}
}

func mustJSON(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return b
}

func misbehaveJob(mode string) *pb.Job {
	return newJob("j", "demo.misbehave", `{"mode":"`+mode+`"}`)
}

// startMisbehaving starts a demo executor on a demo.misbehave job and consumes
// hello, ACCEPTED and RUNNING.
func startMisbehaving(t *testing.T, mode string) *demo {
	t.Helper()
	d := startDemo(t)
	d.Hello()
	d.SendJob(misbehaveJob(mode))
	d.Started("j")
	return d
}

func TestMisbehave(t *testing.T) {
	t.Run("crash", func(t *testing.T) {
		d := startMisbehaving(t, "crash")
		if err := d.EndOfStream(); err.Error() != "EOF" {
			t.Fatalf("stdout: %v, want EOF without a terminal", err)
		}
		if code := d.wait(); code != 3 {
			t.Fatalf("exit status %d, want 3", code)
		}
	})

	t.Run("garbage", func(t *testing.T) {
		d := startMisbehaving(t, "garbage")
		err := d.EndOfStream()
		if !errors.Is(err, executor.ErrTruncatedFrame) && !errors.Is(err, executor.ErrMalformedFrame) {
			t.Fatalf("stdout after RUNNING decoded as %v, want an undecodable frame", err)
		}
		if code := d.wait(); code != 3 {
			t.Fatalf("exit status %d, want 3", code)
		}
		raw := []byte(string(d.Raw()))
		if len(raw) < 64 {
			t.Fatalf("stdout is %d bytes", len(raw))
		}
		junk := raw[len(raw)-64:]
		if junk[0] != 0xff || bytes.ContainsFunc(junk[1:], func(r rune) bool { return r < 0x20 || r > 0x7e }) {
			t.Fatalf("last 64 stdout bytes = %q, want 0xff then text", junk)
		}
		// Nothing but hello, ACCEPTED, RUNNING precedes them.
		if frames := decodeAll(t, raw[:len(raw)-64]); len(frames) != 3 {
			t.Fatalf("%d frames before the garbage", len(frames))
		}
	})

	t.Run("oversize", func(t *testing.T) {
		d := startMisbehaving(t, "oversize")
		err := d.EndOfStream()
		var tl *executor.FrameTooLargeError
		if !errors.As(err, &tl) || tl.Size != 64<<20 {
			t.Fatalf("stdout after RUNNING: %v, want a header announcing 64 MiB", err)
		}
		if code := d.wait(); code != 3 {
			t.Fatalf("exit status %d, want 3", code)
		}
		raw := []byte(string(d.Raw()))
		hdr := protowire.AppendVarint(nil, 64<<20)
		prefix := raw[:len(raw)-1024-len(hdr)]
		if !bytes.Equal(raw[len(prefix):len(prefix)+len(hdr)], hdr) || len(decodeAll(t, prefix)) != 3 {
			t.Fatalf("stdout does not end with 3 frames, a 64 MiB header and 1024 bytes")
		}
	})

	t.Run("backwards", func(t *testing.T) {
		d := startMisbehaving(t, "backwards")
		d.Event("j", 5, pb.EventKind_EVENT_KIND_PROGRESS)
		d.Event("j", 3, pb.EventKind_EVENT_KIND_PROGRESS)
		d.NoFrame(50 * time.Millisecond)
		d.Cancel("j")
		d.JobError("j", 3, executor.CodeCancelled)
		d.closeAndExpectExit()
	})

	t.Run("after_terminal", func(t *testing.T) {
		d := startMisbehaving(t, "after_terminal")
		r := d.Result("j", 3)
		jsonEqual(t, "output", r.GetOutput(), `{"mode":"after_terminal"}`)
		d.Event("j", 4, pb.EventKind_EVENT_KIND_PROGRESS)
		d.NoFrame(50 * time.Millisecond)
		d.Cancel("j")
		// The JobResult was the terminal: the SDK adds no CANCELLED of its own.
		d.NoFrame(100 * time.Millisecond)
		d.closeAndExpectExit()
	})

	t.Run("hang", func(t *testing.T) {
		d := startMisbehaving(t, "hang")
		d.NoFrame(300 * time.Millisecond)
		sent := time.Now()
		d.Cancel("j")
		d.JobError("j", 3, executor.CodeCancelled)
		if took := time.Since(sent); took > 100*time.Millisecond {
			t.Fatalf("hang took %s to answer a cancel", took)
		}
		d.closeAndExpectExit()
	})

	t.Run("ignore_cancel", func(t *testing.T) {
		d := startMisbehaving(t, "ignore_cancel")
		d.Event("j", 3, pb.EventKind_EVENT_KIND_PROGRESS) // the SIGTERM handler is installed
		d.Cancel("j")
		d.NoFrame(200 * time.Millisecond)
		if err := syscall.Kill(d.cmd.Process.Pid, syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		d.NoFrame(200 * time.Millisecond)
		select {
		case <-d.exited:
			t.Fatal("the process exited on SIGTERM")
		default:
		}
		if err := syscall.Kill(d.cmd.Process.Pid, 0); err != nil {
			t.Fatalf("the process is gone after SIGTERM: %v", err)
		}
		_ = syscall.Kill(-d.pgid, syscall.SIGKILL)
		if code := d.wait(); code != -1 {
			t.Fatalf("exit code %d after SIGKILL, want -1 (signalled)", code)
		}
	})

	t.Run("grandchild", func(t *testing.T) {
		d := startMisbehaving(t, "grandchild")
		r := d.Result("j", 3)
		var out struct {
			Pid int `json:"grandchild_pid"`
		}
		if err := json.Unmarshal(r.GetOutput(), &out); err != nil || out.Pid <= 0 {
			t.Fatalf("output %s: %v", r.GetOutput(), err)
		}
		pgid, err := syscall.Getpgid(out.Pid)
		if err != nil || pgid != d.pgid {
			t.Fatalf("grandchild %d: pgid %d (%v), want the executor's group %d", out.Pid, pgid, err, d.pgid)
		}
		// Kill the group before reaping the leader, then check the grandchild died.
		if err := syscall.Kill(-d.pgid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		d.wait()
		deadline := time.Now().Add(waitTimeout)
		for alive(out.Pid) {
			if time.Now().After(deadline) {
				t.Fatalf("grandchild %d survived SIGKILL to its group", out.Pid)
			}
			time.Sleep(10 * time.Millisecond)
		}
	})

	t.Run("stdout_print", func(t *testing.T) {
		d := startMisbehaving(t, "stdout_print")
		r := d.Result("j", 3)
		jsonEqual(t, "output", r.GetOutput(), `{"lines_printed":1000}`)
		d.closeAndExpectExit() // stdout decoded as clean frames up to EOF
		lines := 0
		for _, l := range strings.Split(d.stderr.String(), "\n") {
			if strings.HasPrefix(l, "demo.misbehave stdout_print: line ") {
				lines++
			}
		}
		if lines != 1000 {
			t.Fatalf("%d stdout_print lines on stderr, want 1000", lines)
		}
	})

	t.Run("stderr_flood", func(t *testing.T) {
		d := startMisbehaving(t, "stderr_flood")
		r := d.Result("j", 3)
		jsonEqual(t, "output", r.GetOutput(), `{"stderr_bytes":50000000}`)
		d.closeAndExpectExit()
		if got := d.stderr.Total(); got < 50_000_000 {
			t.Fatalf("stderr carried %d bytes, want >= 50 MB", got)
		}
	})

	t.Run("unknown mode", func(t *testing.T) {
		frames := runOne(t, misbehaveJob("teleport"))
		if e := frames[0].GetError(); e.GetCode() != executor.CodeBadInput || !strings.Contains(e.GetMessage(), "teleport") {
			t.Fatalf("frames = %v", frames)
		}
	})
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	stat, err := os.ReadFile("/proc/" + itoa(pid) + "/stat")
	if err != nil {
		return false // reaped
	}
	// Field 3, after the parenthesised command name, is the state.
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

// decodeAll decodes b as a sequence of complete frames.
func decodeAll(t *testing.T, b []byte) []*pb.ExecutorFrame {
	t.Helper()
	fr := executor.NewFrameReader(bytes.NewReader(b), 0)
	var frames []*pb.ExecutorFrame
	for {
		f := &pb.ExecutorFrame{}
		err := fr.Read(f)
		if err != nil {
			if err.Error() != "EOF" {
				t.Fatalf("frame %d: %v", len(frames), err)
			}
			return frames
		}
		frames = append(frames, f)
	}
}

func TestParseLabels(t *testing.T) {
	got, err := parseLabels(" a=1 ,b = two=2,, c= ")
	if err != nil || !reflect.DeepEqual(got, map[string]string{"a": "1", "b": "two=2", "c": ""}) {
		t.Fatalf("parseLabels = %v, %v", got, err)
	}
	for _, bad := range []string{"x", "=1", "a=1,a=2"} {
		if _, err := parseLabels(bad); err == nil {
			t.Errorf("parseLabels(%q) accepted", bad)
		}
	}
	if got, err := parseKinds(""); err != nil || !slices.Equal(got, allDemoKinds) {
		t.Fatalf("parseKinds(\"\") = %v, %v", got, err)
	}
}
