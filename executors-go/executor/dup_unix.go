//go:build unix && !linux

package executor

import "syscall"

// dupTo makes newfd a copy of oldfd. The new descriptor is inheritable, as
// fds 0-2 must be.
func dupTo(oldfd, newfd int) error { return syscall.Dup2(oldfd, newfd) }
