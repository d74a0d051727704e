//go:build unix

package executor_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// helperEnv makes the test binary act as an executor (see TestMain).
const helperEnv = "DURABLE_EXECUTOR_TEST_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "run":
		os.Exit(helperMain())
	case "claim":
		os.Exit(claimingMain())
	}
	os.Exit(m.Run())
}

// helperMain is an executor whose handler writes to stdout in every way a
// careless handler could.
func helperMain() int {
	ex := executor.New(executor.Options{ExecutorKind: "go"})
	ex.Handle("noisy", func(context.Context, *executor.Job) (*executor.Result, error) {
		fmt.Println("stray fmt.Println")
		os.Stdout.WriteString("stray os.Stdout write\n")
		cmd := exec.Command("sh", "-c", "echo stray child echo; cat >/dev/null")
		cmd.Stdout = os.Stdout // fd 1, which Run pointed at stderr
		cmd.Stdin = os.Stdin   // fd 0, which Run pointed at /dev/null
		if err := cmd.Run(); err != nil {
			return nil, err
		}
		return executor.NewResult("quiet frames")
	})
	return ex.Run()
}

// claimingMain is the README's advice: ClaimStdio first thing in main, so
// that what the program prints while it starts, before Run, goes to stderr
// instead of ahead of the hello. Run then serves on the claimed streams.
func claimingMain() int {
	in, out, err := executor.ClaimStdio()
	if err != nil {
		fmt.Fprintln(os.Stderr, "ClaimStdio:", err)
		return 9
	}
	fmt.Println("starting up: printed before Run")
	if in2, out2, err := executor.ClaimStdio(); err != nil || in2 != in || out2 != out {
		fmt.Fprintln(os.Stderr, "a second ClaimStdio returned other streams:", err)
		return 9
	}
	ex := executor.New(executor.Options{ExecutorKind: "go"})
	ex.Handle("echo", func(_ context.Context, j *executor.Job) (*executor.Result, error) {
		fmt.Println("printed by the handler")
		return &executor.Result{Output: j.Input}, nil
	})
	return ex.Run()
}

// startHelper runs this test binary as the helper executor `mode`, with its
// stdin and stdout as pipes and its stderr collected.
func startHelper(t *testing.T, mode string) (*exec.Cmd, io.WriteCloser, io.ReadCloser, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	stderr := &bytes.Buffer{}
	cmd.Stderr = stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, stdin, stdout, stderr
}

func TestClaimStdioBeforeRunKeepsStartupOutputOffTheFrameStream(t *testing.T) {
	cmd, stdin, stdout, stderr := startHelper(t, "claim")
	defer cmd.Process.Kill()
	deadline := time.AfterFunc(waitTimeout, func() { cmd.Process.Kill() })
	defer deadline.Stop()

	b, _ := executor.MarshalFrame(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: job("j", "echo", `"hi"`)}})
	if _, err := stdin.Write(b); err != nil {
		t.Fatal(err)
	}
	fr := executor.NewFrameReader(stdout, 0)
	var frames []*pb.ExecutorFrame
	for len(frames) < 4 {
		f := &pb.ExecutorFrame{}
		if err := fr.Read(f); err != nil {
			t.Fatalf("frame %d: %v (stderr: %s)", len(frames), err, stderr.String())
		}
		frames = append(frames, f)
	}
	stdin.Close()
	if rest, err := io.ReadAll(stdout); err != nil || len(rest) != 0 {
		t.Fatalf("bytes after the terminal: %q, %v", rest, err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("executor exit: %v (stderr: %s)", err, stderr.String())
	}
	if frames[0].GetHello() == nil || string(frames[3].GetResult().GetOutput()) != `"hi"` {
		t.Fatalf("frames = %v", frames)
	}
	for _, line := range []string{"starting up: printed before Run", "printed by the handler"} {
		if !strings.Contains(stderr.String(), line+"\n") {
			t.Errorf("stderr lacks %q: %q", line, stderr.String())
		}
	}
}

func TestRunKeepsStrayStdoutOffTheFrameStream(t *testing.T) {
	cmd, stdin, stdout, stderr := startHelper(t, "run")
	defer cmd.Process.Kill()

	b, _ := executor.MarshalFrame(&pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: job("j", "noisy", "")}})
	if _, err := stdin.Write(b); err != nil {
		t.Fatal(err)
	}
	// Closing stdin right away: the job still runs, the handler's child reads
	// /dev/null rather than the frame stream, and the SDK cancels the job only
	// if EOF arrives before the handler finishes. Read until the terminal first.
	fr := executor.NewFrameReader(stdout, 0)
	var frames []*pb.ExecutorFrame
	deadline := time.AfterFunc(waitTimeout, func() { cmd.Process.Kill() })
	defer deadline.Stop()
	for {
		f := &pb.ExecutorFrame{}
		if err := fr.Read(f); err != nil {
			t.Fatalf("frame %d: %v (stderr: %s)", len(frames), err, stderr.String())
		}
		frames = append(frames, f)
		if f.GetResult() != nil || f.GetError() != nil {
			break
		}
	}
	stdin.Close()
	rest, err := io.ReadAll(stdout)
	if err != nil || len(rest) != 0 {
		t.Fatalf("bytes after the terminal: %q, %v", rest, err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("executor exit: %v (stderr: %s)", err, stderr.String())
	}
	if len(frames) != 4 || frames[0].GetHello() == nil || frames[0].GetHello().GetPid() != uint32(cmd.Process.Pid) ||
		string(frames[3].GetResult().GetOutput()) != `"quiet frames"` {
		t.Fatalf("frames = %v", frames)
	}
	for _, line := range []string{"stray fmt.Println", "stray os.Stdout write", "stray child echo"} {
		if !strings.Contains(stderr.String(), line+"\n") {
			t.Errorf("stderr lacks %q: %q", line, stderr.String())
		}
	}
}

// Run polls a pipe on stdin (non-blocking, through the runtime's poller) but
// leaves any other stdin as it found it: O_NONBLOCK belongs to the open file
// description, which a terminal or a file shares with whoever started the
// executor. The helper starts on each kind of stdin, sees EOF at once and
// exits 0; the flags are then read back through the parent's descriptor of
// the same description.
func TestRunMakesOnlyAPipeStdinNonBlocking(t *testing.T) {
	file, err := os.CreateTemp(t.TempDir(), "stdin")
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pr.Close()
	pw.Close() // EOF for the executor at once
	for _, tc := range []struct {
		name        string
		stdin       *os.File
		nonBlocking bool
	}{
		{"regular file", file, false},
		{"pipe", pr, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), helperEnv+"=run")
			cmd.Stdin = tc.stdin
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("executor exit: %v (stderr: %s)", err, stderr.String())
			}
			flags, err := fcntlGetFlags(tc.stdin)
			if err != nil {
				t.Fatal(err)
			}
			if got := flags&syscall.O_NONBLOCK != 0; got != tc.nonBlocking {
				t.Fatalf("O_NONBLOCK on the %s after the executor ran = %v, want %v", tc.name, got, tc.nonBlocking)
			}
		})
	}
}

func fcntlGetFlags(f *os.File) (int, error) {
	raw, err := f.SyscallConn()
	if err != nil {
		return 0, err
	}
	var flags int
	var ferr error
	if err := raw.Control(func(fd uintptr) {
		r, _, errno := syscall.Syscall(syscall.SYS_FCNTL, fd, syscall.F_GETFL, 0)
		flags, ferr = int(r), nil
		if errno != 0 {
			ferr = errno
		}
	}); err != nil {
		return 0, err
	}
	return flags, ferr
}
