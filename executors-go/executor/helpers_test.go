package executor_test

import (
	"errors"
	"log/slog"
	"reflect"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/durable-runtime/durable/executors-go/executor"
	"github.com/durable-runtime/durable/executors-go/executortest"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// waitTimeout bounds the waits these tests do themselves; a healthy run takes
// milliseconds.
const waitTimeout = executortest.DefaultTimeout

// quietLogger discards the SDK's diagnostics during tests.
var quietLogger = slog.New(slog.DiscardHandler)

func newExecutor(opts executor.Options) *executor.Executor {
	if opts.Logger == nil {
		opts.Logger = quietLogger
	}
	return executor.New(opts)
}

func job(id, kind, input string) *pb.Job { return executortest.NewJob(id, kind, input) }

func protoEqual(t *testing.T, what string, got, want proto.Message) {
	t.Helper()
	if !proto.Equal(got, want) {
		t.Fatalf("%s:\n got %v\nwant %v", what, got, want)
	}
}

func isErr(t *testing.T, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("error %v: want one matching %v", err, target)
	}
}

func waitClosed(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(waitTimeout):
		t.Fatalf("%s did not happen within %s", what, waitTimeout)
	}
}

// exportedEqual compares the exported fields of two structs of one type.
func exportedEqual(a, b any) bool {
	va, vb := reflect.ValueOf(a), reflect.ValueOf(b)
	if va.Type() != vb.Type() {
		return false
	}
	for i := 0; i < va.NumField(); i++ {
		if va.Type().Field(i).IsExported() && !reflect.DeepEqual(va.Field(i).Interface(), vb.Field(i).Interface()) {
			return false
		}
	}
	return true
}
