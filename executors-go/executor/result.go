package executor

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// Result is a handler's successful outcome.
type Result struct {
	// Output is the step's output JSON value; empty means JSON null.
	Output json.RawMessage
	// Artifacts lists the files the handler wrote below Job.OutputDir.
	Artifacts []Artifact
}

// Artifact is one entry of the artifact manifest.
type Artifact struct {
	Name string
	// Path is relative to Job.OutputDir: no "..", not absolute.
	Path string
	// SHA256 is the lower-case hex SHA-256 of the file's bytes.
	SHA256    string
	Size      uint64
	MediaType string
	// DerivedFrom holds the ids (ArtifactRef.ID) of the input artifacts this
	// one was derived from.
	DerivedFrom []string
}

// NewResult marshals output to JSON and returns a Result with the given
// artifacts.
func NewResult(output any, artifacts ...Artifact) (*Result, error) {
	b, err := json.Marshal(output)
	if err != nil {
		return nil, fmt.Errorf("executor: encoding the output as JSON: %w", err)
	}
	return &Result{Output: b, Artifacts: artifacts}, nil
}

// FileArtifact builds the manifest entry of a file the handler wrote at rel
// below Job.OutputDir: it hashes and sizes the file. name defaults to the
// file's base name.
func (j *Job) FileArtifact(name, rel, mediaType string, derivedFrom ...string) (Artifact, error) {
	full, err := j.OutputPath(rel)
	if err != nil {
		return Artifact{}, err
	}
	f, err := os.Open(full)
	if err != nil {
		return Artifact{}, fmt.Errorf("executor: artifact %q: %w", rel, err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return Artifact{}, fmt.Errorf("executor: artifact %q: %w", rel, err)
	}
	if !info.Mode().IsRegular() {
		return Artifact{}, fmt.Errorf("executor: artifact %q is not a regular file (mode %s)", rel, info.Mode())
	}
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return Artifact{}, fmt.Errorf("executor: artifact %q: hashing: %w", rel, err)
	}
	if name == "" {
		name = filepath.Base(rel)
	}
	return Artifact{
		Name:        name,
		Path:        filepath.ToSlash(filepath.Clean(rel)),
		SHA256:      hex.EncodeToString(h.Sum(nil)),
		Size:        uint64(n),
		MediaType:   mediaType,
		DerivedFrom: append([]string(nil), derivedFrom...),
	}, nil
}
