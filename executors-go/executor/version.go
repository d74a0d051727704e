package executor

import (
	"reflect"
	"runtime/debug"
	"strings"
	"sync"
)

// SDKName is sent as Hello.sdk_name unless Options.SDKName overrides it.
const SDKName = "durable-executor-go"

// Version returns this SDK's version, sent as Hello.sdk_version unless
// Options.SDKVersion overrides it.
//
// It is not kept by hand: it is the version of the module
// github.com/durable-runtime/durable/executors-go that the Go toolchain
// recorded in the binary's build information (the module's git tag, say
// "v0.2.0", or a pseudo-version), and "devel" when the binary was built from
// a work tree without one (go test, go build inside the repository, a replace
// directive pointing at a directory) or carries no build information.
func Version() string { return versionOnce() }

var versionOnce = sync.OnceValue(func() string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "devel"
	}
	return moduleVersion(bi, sdkModulePath())
})

// sdkModulePath is this package's module path: its import path without the
// last element ("…/executors-go/executor" → "…/executors-go").
func sdkModulePath() string {
	pkg := reflect.TypeFor[Executor]().PkgPath()
	if i := strings.LastIndexByte(pkg, '/'); i >= 0 {
		return pkg[:i]
	}
	return pkg
}

// moduleVersion finds module's version in bi: the main module's when the SDK
// is built as part of it, else the dependency's (its replacement's, if any).
func moduleVersion(bi *debug.BuildInfo, module string) string {
	m := &bi.Main
	if m.Path != module {
		m = nil
		for _, d := range bi.Deps {
			if d.Path == module {
				m = d
				break
			}
		}
	}
	if m == nil {
		return "devel"
	}
	if m.Replace != nil {
		m = m.Replace
	}
	if m.Version == "" || m.Version == "(devel)" {
		return "devel"
	}
	return m.Version
}
