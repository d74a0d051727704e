//go:build linux

package executor

import "syscall"

// dupTo makes newfd a copy of oldfd (dup2; linux/arm64 only has dup3). The new
// descriptor is inheritable, as fds 0-2 must be.
func dupTo(oldfd, newfd int) error { return syscall.Dup3(oldfd, newfd, 0) }
