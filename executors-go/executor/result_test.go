package executor_test

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/durable-runtime/durable/executors-go/executor"
)

func TestFileArtifact(t *testing.T) {
	dir := t.TempDir()
	j := &executor.Job{OutputDir: dir}
	content := []byte(strings.Repeat("artifact bytes\n", 1000))
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sub", "out.txt"), content, 0o644); err != nil {
		t.Fatal(err)
	}
	sum := hex.EncodeToString(func() []byte { s := sha256.Sum256(content); return s[:] }())

	got, err := j.FileArtifact("sub/out.txt", &executor.ArtifactOptions{MediaType: "text/plain", DerivedFrom: []string{"in-1", "in-2"}})
	if err != nil {
		t.Fatal(err)
	}
	want := executor.Artifact{Name: "out.txt", Path: "sub/out.txt", SHA256: sum, Size: uint64(len(content)),
		MediaType: "text/plain", DerivedFrom: []string{"in-1", "in-2"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("FileArtifact:\n got %+v\nwant %+v", got, want)
	}

	// Defaults (nil options), an unclean relative path, an absolute path
	// inside the directory, a symbolic link inside it: all name the same file.
	if err := os.Symlink(filepath.Join("sub", "out.txt"), filepath.Join(dir, "link.txt")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"sub/./out.txt", filepath.Join(dir, "sub", "out.txt"), "link.txt"} {
		got, err := j.FileArtifact(p, nil)
		want := executor.Artifact{Name: "out.txt", Path: "sub/out.txt", SHA256: sum, Size: uint64(len(content)), MediaType: executor.DefaultMediaType}
		if err != nil || !reflect.DeepEqual(got, want) {
			t.Errorf("FileArtifact(%q, nil) = %+v, %v; want %+v", p, got, err, want)
		}
	}
	if got, _ := j.FileArtifact("sub/out.txt", &executor.ArtifactOptions{Name: "named"}); got.Name != "named" {
		t.Errorf("FileArtifact with a name: %+v", got)
	}

	// Outside the directory, missing, not a regular file: ARTIFACT_INVALID,
	// not retryable.
	outside := filepath.Join(t.TempDir(), "outside.txt")
	if err := os.WriteFile(outside, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "escape.txt")); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"../outside.txt", outside, "escape.txt", "", "sub/../../x", "missing.txt", "sub", "."} {
		_, err := j.FileArtifact(bad, nil)
		var xe *executor.Error
		if !errors.As(err, &xe) || xe.Code != executor.CodeArtifactInvalid || !xe.NonRetryable {
			t.Errorf("FileArtifact(%q) = %v, want an ARTIFACT_INVALID *Error", bad, err)
		}
	}
	if _, err := j.FileArtifact("missing.txt", nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("FileArtifact(missing) = %v, want one matching os.ErrNotExist", err)
	}
	if _, err := (&executor.Job{}).FileArtifact("x", nil); err == nil {
		t.Error("FileArtifact without an output directory succeeded")
	}
}

func TestNewResult(t *testing.T) {
	r, err := executor.NewResult(map[string]any{"b": 2, "a": []int{1}}, executor.Artifact{Name: "x"})
	if err != nil || string(r.Output) != `{"a":[1],"b":2}` || len(r.Artifacts) != 1 {
		t.Fatalf("NewResult = %+v, %v", r, err)
	}
	_, err = executor.NewResult(make(chan int))
	var xe *executor.Error
	if !errors.As(err, &xe) || xe.Code != executor.CodeOutputInvalid || !xe.NonRetryable {
		t.Fatalf("NewResult(a channel) = %v, want an OUTPUT_INVALID *Error", err)
	}
}

func TestDecodeInput(t *testing.T) {
	var v struct{ A int }
	v.A = 7
	for _, in := range []string{"", "  ", "null"} {
		if err := (&executor.Job{Input: []byte(in)}).DecodeInput(&v); err != nil || v.A != 7 {
			t.Fatalf("DecodeInput(%q) = %v, left %+v", in, err, v)
		}
	}
	err := (&executor.Job{Kind: "k", Input: []byte(`[1]`)}).DecodeInput(&v)
	xe, ok := err.(*executor.Error)
	if !ok || xe.Code != executor.CodeBadInput || !xe.NonRetryable || !strings.Contains(xe.Message, `"k"`) {
		t.Fatalf("DecodeInput(array into struct) = %#v", err)
	}
}

// OutputPath refuses any ".." part, even one that stays inside the output
// directory, as the Python SDK's output_path does (SDK audit: "a/../x.txt"
// was accepted, contradicting both SDKs' docs).
func TestOutputPathRefusesDotDot(t *testing.T) {
	j := &executor.Job{OutputDir: "/out"}
	for _, rel := range []string{"a/../x.txt", "..", "a/..", "/abs", "", "a\x00b"} {
		if p, err := j.OutputPath(rel); err == nil {
			t.Errorf("OutputPath(%q) = %q, want an error", rel, p)
		}
	}
	for rel, want := range map[string]string{"x.txt": "/out/x.txt", "a/b.csv": "/out/a/b.csv", "a..b": "/out/a..b"} {
		if p, err := j.OutputPath(rel); err != nil || p != want {
			t.Errorf("OutputPath(%q) = %q, %v; want %q", rel, p, err, want)
		}
	}
}
