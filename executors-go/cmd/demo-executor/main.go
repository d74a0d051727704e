// Command demo-executor is the Go demo executor: the job kinds of the "Demo
// executors" table in proto/PROTOCOL.md, used by tests, `supervisor dev` and
// acceptance checks.
//
// Environment:
//
//	DEMO_LABELS  labels offered in Hello, "k=v,k2=v2" (default none)
//	DEMO_KINDS   kinds to register, comma separated (default all)
//	GOMAXPROCS   as for any Go program; unset, the demo runs with 1 (see run)
//
// Exit status: 0 after a clean end, 1 after a broken frame stream, 2 for a bad
// environment, 3 when a demo kind crashes on purpose.
package main

import (
	"fmt"
	"os"
	"runtime"
	"sort"
	"strings"

	"github.com/durable-runtime/durable/executors-go/executor"
)

// handlers maps every demo kind to its handler.
var handlers = map[string]executor.HandlerFunc{
	"demo.echo":             echo,
	"demo.sleep":            sleep,
	"demo.fail":             fail,
	"demo.artifact":         artifact,
	"demo.effect":           effect,
	"demo.misbehave":        misbehave,
	"demo.finish_on_cancel": finishOnCancel,
	"demo.resume":           resume,
}

func main() {
	os.Exit(run())
}

func run() int {
	// The demo's handlers do no parallel work, and a persistent pool keeps
	// many of these processes warm on few cores (64 on two in the benchmark):
	// with a P per core each job's frames are handed between OS threads, and
	// a warm process spent ~40 % more CPU per no-op job (perf, issue 7). One
	// P keeps a job's goroutines on one thread. A GOMAXPROCS in the
	// environment still wins.
	if os.Getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
	labels, err := parseLabels(os.Getenv("DEMO_LABELS"))
	if err != nil {
		fmt.Fprintf(os.Stderr, "demo-executor: DEMO_LABELS: %v\n", err)
		return 2
	}
	kinds, err := parseKinds(os.Getenv("DEMO_KINDS"))
	if err != nil {
		fmt.Fprintf(os.Stderr, "demo-executor: DEMO_KINDS: %v\n", err)
		return 2
	}
	// NoDeadline: the demos leave the job's deadlines to the supervisor, so
	// that a demo.sleep past its timeout ends with the supervisor's
	// ATTEMPT_TIMEOUT or DEADLINE_EXCEEDED, as the Python demo's does
	// (PROTOCOL.md's demo table), not with the SDK's HANDLER_TIMEOUT.
	ex := executor.New(executor.Options{ExecutorKind: "go", Labels: labels, NoDeadline: true})
	for _, k := range kinds {
		ex.Handle(k, handlers[k])
	}
	return ex.Run()
}

// parseLabels parses "k=v,k2=v2". Blank entries are skipped; keys are trimmed
// and must be non-empty and unique.
func parseLabels(s string) (map[string]string, error) {
	labels := map[string]string{}
	for _, entry := range strings.Split(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		k, v, ok := strings.Cut(entry, "=")
		k = strings.TrimSpace(k)
		if !ok || k == "" {
			return nil, fmt.Errorf("entry %q is not key=value", entry)
		}
		if _, dup := labels[k]; dup {
			return nil, fmt.Errorf("label %q given twice", k)
		}
		labels[k] = strings.TrimSpace(v)
	}
	return labels, nil
}

// parseKinds parses a comma-separated list of demo kinds; empty means all.
func parseKinds(s string) ([]string, error) {
	var kinds []string
	seen := map[string]bool{}
	for _, k := range strings.Split(s, ",") {
		k = strings.TrimSpace(k)
		if k == "" || seen[k] {
			continue
		}
		if handlers[k] == nil {
			return nil, fmt.Errorf("unknown kind %q (known: %s)", k, strings.Join(allKinds(), ", "))
		}
		seen[k] = true
		kinds = append(kinds, k)
	}
	if len(kinds) == 0 {
		return allKinds(), nil
	}
	return kinds, nil
}

func allKinds() []string {
	kinds := make([]string, 0, len(handlers))
	for k := range handlers {
		kinds = append(kinds, k)
	}
	sort.Strings(kinds)
	return kinds
}
