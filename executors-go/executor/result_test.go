package executor

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestFileArtifact(t *testing.T) {
	dir := t.TempDir()
	j := &Job{OutputDir: dir}
	content := []byte(strings.Repeat("artifact bytes\n", 1000))
	if err := os.MkdirAll(filepath.Join(dir, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sub", "out.txt"), content, 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(content)

	got, err := j.FileArtifact("", "sub/out.txt", "text/plain", "in-1", "in-2")
	if err != nil {
		t.Fatal(err)
	}
	want := Artifact{Name: "out.txt", Path: "sub/out.txt", SHA256: hex.EncodeToString(sum[:]), Size: uint64(len(content)),
		MediaType: "text/plain", DerivedFrom: []string{"in-1", "in-2"}}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("FileArtifact:\n got %+v\nwant %+v", got, want)
	}
	if got, _ := j.FileArtifact("named", "sub/./out.txt", ""); got.Name != "named" || got.Path != "sub/out.txt" || got.DerivedFrom != nil {
		t.Fatalf("FileArtifact with a name and an unclean path: %+v", got)
	}

	for _, bad := range []string{"../escape.txt", "/etc/passwd", "", "sub/../../x"} {
		if _, err := j.FileArtifact("", bad, ""); err == nil || !strings.Contains(err.Error(), "not a relative path") {
			t.Errorf("FileArtifact(%q) = %v, want a path error", bad, err)
		}
	}
	if _, err := j.FileArtifact("", "sub", ""); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Errorf("FileArtifact(directory) = %v", err)
	}
	if _, err := j.FileArtifact("", "missing.txt", ""); !os.IsNotExist(unwrapAll(err)) {
		t.Errorf("FileArtifact(missing) = %v", err)
	}
}

func unwrapAll(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok || u.Unwrap() == nil {
			return err
		}
		err = u.Unwrap()
	}
}

func TestNewResult(t *testing.T) {
	r, err := NewResult(map[string]any{"b": 2, "a": []int{1}}, Artifact{Name: "x"})
	if err != nil || string(r.Output) != `{"a":[1],"b":2}` || len(r.Artifacts) != 1 {
		t.Fatalf("NewResult = %+v, %v", r, err)
	}
	if _, err := NewResult(make(chan int)); err == nil {
		t.Fatal("NewResult accepted a value JSON cannot encode")
	}
}

func TestDecodeInput(t *testing.T) {
	var v struct{ A int }
	v.A = 7
	for _, in := range []string{"", "  ", "null"} {
		if err := (&Job{Input: []byte(in)}).DecodeInput(&v); err != nil || v.A != 7 {
			t.Fatalf("DecodeInput(%q) = %v, left %+v", in, err, v)
		}
	}
	err := (&Job{Kind: "k", Input: []byte(`[1]`)}).DecodeInput(&v)
	xe, ok := err.(*Error)
	if !ok || xe.Code != CodeBadInput || xe.Retryable || !strings.Contains(xe.Message, `"k"`) {
		t.Fatalf("DecodeInput(array into struct) = %#v", err)
	}
}
