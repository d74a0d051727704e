//go:build unix

package executor

import (
	"fmt"
	"os"
	"syscall"
)

// takeStdio moves the frame streams off the standard descriptors:
//   - stdout is duplicated to a private close-on-exec descriptor that carries
//     frames only, and fd 1 is pointed at stderr, so os.Stdout, fmt.Println and
//     child processes inheriting fd 1 write to stderr instead of corrupting
//     frames;
//   - stdin is duplicated likewise, and fd 0 reads /dev/null, so no child
//     process can consume frames meant for the SDK.
//
// os.Stdout and os.Stdin keep wrapping fds 1 and 0, which now refer to stderr
// and /dev/null.
func takeStdio() (in, out *os.File, err error) {
	// Hold the fork lock so no concurrent fork inherits the new descriptors
	// between dup and close-on-exec.
	syscall.ForkLock.RLock()
	defer syscall.ForkLock.RUnlock()

	outFd, err := syscall.Dup(1)
	if err != nil {
		return nil, nil, fmt.Errorf("dup stdout: %w", err)
	}
	syscall.CloseOnExec(outFd)
	inFd, err := syscall.Dup(0)
	if err != nil {
		syscall.Close(outFd)
		return nil, nil, fmt.Errorf("dup stdin: %w", err)
	}
	syscall.CloseOnExec(inFd)

	if err := dupTo(2, 1); err != nil {
		syscall.Close(outFd)
		syscall.Close(inFd)
		return nil, nil, fmt.Errorf("point fd 1 at stderr: %w", err)
	}
	if null, err := syscall.Open(os.DevNull, syscall.O_RDONLY|syscall.O_CLOEXEC, 0); err == nil {
		// Best effort: without it, children merely share stdin with the SDK.
		_ = dupTo(null, 0)
		syscall.Close(null)
	}
	return os.NewFile(uintptr(inFd), "executor-frames-in"), os.NewFile(uintptr(outFd), "executor-frames-out"), nil
}
