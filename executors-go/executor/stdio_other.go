//go:build !unix

package executor

import "os"

// takeStdio on systems without dup2 uses the standard streams directly: stray
// writes to os.Stdout are not diverted there.
func takeStdio() (in, out *os.File, err error) { return os.Stdin, os.Stdout, nil }
