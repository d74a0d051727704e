package executor

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	pathpkg "path"
	"path/filepath"
	"unicode/utf8"
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
// artifacts. A value JSON cannot encode is an *Error with code OUTPUT_INVALID
// (not retryable), so a handler can return it as is.
func NewResult(output any, artifacts ...Artifact) (*Result, error) {
	b, err := json.Marshal(output)
	if err != nil {
		return nil, &Error{Code: CodeOutputInvalid, Message: fmt.Sprintf("encoding the output as JSON: %v", err), NonRetryable: true, Err: err}
	}
	return &Result{Output: b, Artifacts: artifacts}, nil
}

// DefaultMediaType is an artifact's media type when ArtifactOptions leaves it
// empty.
const DefaultMediaType = "application/octet-stream"

// ArtifactOptions are FileArtifact's optional settings; nil means all
// defaults.
type ArtifactOptions struct {
	// Name is the artifact's name; default: the file's base name.
	Name string
	// MediaType defaults to DefaultMediaType.
	MediaType string
	// DerivedFrom holds the ids (ArtifactRef.ID) of the input artifacts the
	// file was derived from.
	DerivedFrom []string
}

// FileArtifact builds the manifest entry of a file the handler wrote below
// Job.OutputDir: it hashes and sizes the file. path is relative to OutputDir
// or absolute; the file it names, symbolic links resolved, must be a regular
// file below OutputDir, and the entry's Path is its location relative to
// OutputDir. (The Python SDK's Job.artifact(path, name=, media_type=,
// derived_from=) has the same rules.)
//
// A path outside OutputDir, a missing file or one that is not a regular file
// is an *Error with code ARTIFACT_INVALID (not retryable); a failure to read
// the file is a plain error.
func (j *Job) FileArtifact(path string, opts *ArtifactOptions) (Artifact, error) {
	if opts == nil {
		opts = &ArtifactOptions{}
	}
	invalid := func(format string, args ...any) (Artifact, error) {
		return Artifact{}, Errorf(CodeArtifactInvalid, false, "artifact %q: "+format, append([]any{path}, args...)...)
	}
	if j.OutputDir == "" {
		return invalid("the job has no output directory")
	}
	if path == "" {
		return invalid("no path")
	}
	base, err := filepath.EvalSymlinks(j.OutputDir)
	if err != nil {
		return invalid("the output directory: %w", err)
	}
	full := path
	if !filepath.IsAbs(full) {
		full = filepath.Join(j.OutputDir, full)
	}
	real, err := filepath.EvalSymlinks(full)
	if err != nil {
		return invalid("%w", err)
	}
	rel, err := filepath.Rel(base, real)
	if err != nil || !filepath.IsLocal(rel) {
		return invalid("not below the output directory %s", j.OutputDir)
	}
	if !utf8.ValidString(rel) {
		// A manifest is protobuf text: the name cannot be sent as it is, and
		// a replaced byte would name another file.
		return invalid("the file name is not valid UTF-8 (rename the file)")
	}
	f, err := os.Open(real)
	if err != nil {
		return Artifact{}, fmt.Errorf("executor: artifact %q: %w", path, err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return Artifact{}, fmt.Errorf("executor: artifact %q: %w", path, err)
	}
	if !info.Mode().IsRegular() {
		return invalid("not a regular file (mode %s)", info.Mode())
	}
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return Artifact{}, fmt.Errorf("executor: artifact %q: hashing: %w", path, err)
	}
	rel = filepath.ToSlash(rel)
	a := Artifact{
		Name:        opts.Name,
		Path:        rel,
		SHA256:      hex.EncodeToString(h.Sum(nil)),
		Size:        uint64(n),
		MediaType:   opts.MediaType,
		DerivedFrom: append([]string(nil), opts.DerivedFrom...),
	}
	if a.Name == "" {
		a.Name = pathpkg.Base(rel)
	}
	if a.MediaType == "" {
		a.MediaType = DefaultMediaType
	}
	return a, nil
}
