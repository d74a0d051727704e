package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
)

// supervisorBin finds the supervisor binary whose `conformance` command this
// test runs: $DURABLE_TEST_SUPERVISOR_BIN (scripts/test sets it after building the
// binary, and then it must exist), else target/debug/supervisor of the
// repository. Without either the test is skipped, saying how to build it.
func supervisorBin(t *testing.T) string {
	t.Helper()
	if p := os.Getenv("DURABLE_TEST_SUPERVISOR_BIN"); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("DURABLE_TEST_SUPERVISOR_BIN=%s: %v (scripts/test builds it with `cargo build --workspace --bins`)", p, err)
		}
		return p
	}
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(root, "target", "debug", "supervisor")
	if _, err := os.Stat(p); errors.Is(err, os.ErrNotExist) {
		t.Skipf("the supervisor binary %s is absent: build it with `cargo build -p supervisor` (scripts/test does) to run `supervisor conformance` against the demo executor", p)
	}
	return p
}

// conformanceReport is the part of `supervisor conformance --json` read here.
type conformanceReport struct {
	Passed    bool     `json:"passed"`
	Scenarios []string `json:"scenarios"`
	Executors []struct {
		Executor  string `json:"executor"`
		Passed    bool   `json:"passed"`
		Scenarios []struct {
			Scenario string `json:"scenario"`
			Result   string `json:"result"`
			Detail   string `json:"detail"`
		} `json:"scenarios"`
	} `json:"executors"`
}

// The protocol's behaviour scenarios are the supervisor's (`supervisor
// conformance`, one implementation for every language): the demo executor
// passes every one of them, none skipped.
func TestSupervisorConformance(t *testing.T) {
	bin := supervisorBin(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "worker.toml")
	toml := fmt.Sprintf("db_max_connections = 4\nhandshake_timeout_ms = 5000\n\n[[executors]]\nname = \"go-demo\"\ncommand = %s\nconcurrency = 1\n", strconv.Quote(demoBin))
	if err := os.WriteFile(cfg, []byte(toml), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "conformance", "--config", cfg, "--json")
	cmd.Env = append(os.Environ(), "RUST_LOG=warn")
	var stderr capture
	stderr.max = 64 << 10
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var report conformanceReport
	if jerr := json.Unmarshal(out, &report); jerr != nil {
		t.Fatalf("supervisor conformance --json (%v) printed no JSON: %v\nstdout: %s\nstderr: %s", err, jerr, out, stderr.String())
	}
	if len(report.Executors) != 1 || report.Executors[0].Executor != "go-demo" {
		t.Fatalf("report: %s", out)
	}
	got := report.Executors[0]
	if len(got.Scenarios) != len(report.Scenarios) || len(got.Scenarios) < 12 {
		t.Fatalf("%d scenario results for %d scenarios: %s", len(got.Scenarios), len(report.Scenarios), out)
	}
	for _, s := range got.Scenarios {
		if s.Result != "pass" {
			t.Errorf("scenario %q: %s: %s", s.Scenario, s.Result, s.Detail)
		}
	}
	if err != nil || !report.Passed || !got.Passed {
		t.Fatalf("supervisor conformance: %v, passed %v\nstderr: %s", err, report.Passed, stderr.String())
	}
}
