package executor

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestModuleVersion(t *testing.T) {
	const mod = "github.com/durable-runtime/durable/executors-go"
	if got := sdkModulePath(); got != mod {
		t.Fatalf("sdkModulePath() = %q, want %q", got, mod)
	}
	cases := []struct {
		name string
		bi   debug.BuildInfo
		want string
	}{
		{"main module, tagged", debug.BuildInfo{Main: debug.Module{Path: mod, Version: "v1.2.3"}}, "v1.2.3"},
		{"main module, work tree", debug.BuildInfo{Main: debug.Module{Path: mod, Version: "(devel)"}}, "devel"},
		{"dependency", debug.BuildInfo{Main: debug.Module{Path: "example.com/app", Version: "v9.0.0"},
			Deps: []*debug.Module{{Path: "other", Version: "v0.0.1"}, {Path: mod, Version: "v0.4.0"}}}, "v0.4.0"},
		{"replaced by a version", debug.BuildInfo{Main: debug.Module{Path: "example.com/app"},
			Deps: []*debug.Module{{Path: mod, Version: "v0.4.0", Replace: &debug.Module{Path: "fork", Version: "v0.4.1"}}}}, "v0.4.1"},
		{"replaced by a directory", debug.BuildInfo{Main: debug.Module{Path: "example.com/app"},
			Deps: []*debug.Module{{Path: mod, Version: "v0.4.0", Replace: &debug.Module{Path: "../executors-go"}}}}, "devel"},
		{"absent", debug.BuildInfo{Main: debug.Module{Path: "example.com/app"}}, "devel"},
	}
	for _, c := range cases {
		if got := moduleVersion(&c.bi, mod); got != c.want {
			t.Errorf("%s: moduleVersion = %q, want %q", c.name, got, c.want)
		}
	}
	if v := Version(); v != "devel" && !strings.HasPrefix(v, "v") {
		t.Errorf("Version() = %q", v)
	}
}

func TestRedactor(t *testing.T) {
	r := newRedactor(map[string]string{"A": "bcdefg", "B": "abcd", "D": "xy", "E": "", "Q": `q"1/`})
	cases := map[string]string{
		"":           "",
		"xy":         redactedMarker, // short: only as a whole string
		"xyz":        "xyz",
		"a xy b":     "a xy b",
		"abcdefg":    redactedMarker + "efg", // left to right: abcd is found first
		"zzbcdefgzz": "zz" + redactedMarker + "zz",
		`"q\"1/"`:    `"` + redactedMarker + `"`, // JSON-escaped
		"q%221%2F":   redactedMarker,             // percent-encoded
	}
	for in, want := range cases {
		if got := r.str(in); got != want {
			t.Errorf("str(%q) = %q, want %q", in, got, want)
		}
	}
	// A value the marker itself holds: the whole string goes.
	if got := newRedactor(map[string]string{"C": "REDACTED"}).str("the REDACTED word"); got != "***" {
		t.Errorf("a value inside the marker: %q", got)
	}
	if newRedactor(map[string]string{"E": ""}) != nil || newRedactor(nil).str("x") != "x" {
		t.Error("a redactor without values is not a no-op")
	}
}
