// Command golden-gen writes the golden frame files of the executor protocol to
// proto/golden: for each representative frame (or conversation) a <name>.bin
// holding the delimited frames and a <name>.json holding their protojson form.
// The Go, Rust and Python test suites decode every .bin, compare it with the
// .json and re-encode it byte for byte.
//
// Usage, from executors-go/:
//
//	go run ./cmd/golden-gen            # rewrite proto/golden
//	go run ./cmd/golden-gen -check     # exit 1 if proto/golden is out of date
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

func main() {
	dir := flag.String("dir", "", "output directory (default: proto/golden of the enclosing repository)")
	check := flag.Bool("check", false, "compare instead of writing; exit 1 on any difference")
	flag.Parse()
	if *dir == "" {
		root, err := repoRoot()
		if err != nil {
			fmt.Fprintln(os.Stderr, "golden-gen:", err)
			os.Exit(2)
		}
		*dir = filepath.Join(root, "proto", "golden")
	}
	files, err := render()
	if err != nil {
		fmt.Fprintln(os.Stderr, "golden-gen:", err)
		os.Exit(2)
	}
	if *check {
		diffs, err := compare(*dir, files)
		if err != nil {
			fmt.Fprintln(os.Stderr, "golden-gen:", err)
			os.Exit(2)
		}
		for _, d := range diffs {
			fmt.Fprintln(os.Stderr, "golden-gen:", d)
		}
		if len(diffs) > 0 {
			fmt.Fprintln(os.Stderr, "golden-gen: run `go run ./cmd/golden-gen` from executors-go/ to regenerate")
			os.Exit(1)
		}
		return
	}
	if err := write(*dir, files); err != nil {
		fmt.Fprintln(os.Stderr, "golden-gen:", err)
		os.Exit(1)
	}
	fmt.Printf("golden-gen: wrote %d files to %s\n", len(files), *dir)
}

// render returns every golden file's name and bytes.
func render() (map[string][]byte, error) {
	files := map[string][]byte{}
	for _, g := range goldens() {
		bin, err := encodeBin(g.frames)
		if err != nil {
			return nil, fmt.Errorf("%s.bin: %w", g.name, err)
		}
		js, err := encodeJSON(g.direction, g.frames)
		if err != nil {
			return nil, fmt.Errorf("%s.json: %w", g.name, err)
		}
		files[g.name+".bin"], files[g.name+".json"] = bin, js
	}
	return files, nil
}

// isGoldenFile tells the files golden-gen owns in the directory.
func isGoldenFile(name string) bool {
	return strings.HasSuffix(name, ".bin") || strings.HasSuffix(name, ".json")
}

// write makes dir hold exactly files (other than README.md and such).
func write(dir string, files map[string][]byte) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if isGoldenFile(e.Name()) && files[e.Name()] == nil {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				return err
			}
		}
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// compare lists the differences between dir and files.
func compare(dir string, files map[string][]byte) ([]string, error) {
	var diffs []string
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		switch {
		case errors.Is(err, os.ErrNotExist):
			diffs = append(diffs, name+": missing")
		case err != nil:
			return nil, err
		case !bytes.Equal(got, want):
			diffs = append(diffs, name+": differs from what golden-gen writes")
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, e := range entries {
		if isGoldenFile(e.Name()) && files[e.Name()] == nil {
			diffs = append(diffs, e.Name()+": not produced by golden-gen")
		}
	}
	sort.Strings(diffs)
	return diffs, nil
}

// repoRoot walks up from the working directory to the repository holding the
// protocol definition.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "proto", "durable", "executor", "v1", "executor.proto")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no proto/durable/executor/v1/executor.proto above the working directory; pass -dir")
		}
		dir = parent
	}
}
