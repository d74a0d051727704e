// Package executor is the Go SDK for durable executors: child processes that
// run workflow steps for the supervisor and speak the executor protocol v1
// (proto/durable/executor/v1/executor.proto, rules in proto/PROTOCOL.md) as
// varint-length-delimited protobuf frames on stdin and stdout.
//
// An executor registers one handler per job kind (Executor.Handle, or the
// typed HandleJSON) and calls Run; see the examples. The SDK sends Hello,
// answers each Job with ACCEPTED and RUNNING events, runs the handler with a
// context that a Cancel frame cancels and that carries the job's deadline,
// and sends exactly one terminal (JobResult or JobError) per job. Failures
// are retryable unless they say otherwise (Error.NonRetryable), as in the
// Python SDK. Run keeps stray writes to stdout off the frame stream (a
// program that may print before Run calls ClaimStdio first in main); Serve
// runs the same protocol on any reader and writer, and package executortest
// plays the supervisor against it in tests.
package executor
