package executor_test

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"testing/iotest"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// fuzzCap is the frame cap in FuzzReadFrame: small, so that "too large" is
// reachable, and above every golden frame.
const fuzzCap = 64 << 10

// How a stream of frames ends, in the reference model.
type streamEnd int

const (
	endEOF streamEnd = iota
	endTruncated
	endMalformed
	endTooLarge
)

// referenceFrames splits data into frame bodies the slow, obvious way
// (protowire), and says how the stream ends.
func referenceFrames(data []byte, maxBytes int) ([][]byte, streamEnd) {
	var bodies [][]byte
	for {
		if len(data) == 0 {
			return bodies, endEOF
		}
		size, n := protowire.ConsumeVarint(data)
		if n < 0 {
			prefix := data[:min(len(data), 10)]
			allContinue := true
			for _, b := range prefix {
				allContinue = allContinue && b >= 0x80
			}
			if allContinue && len(data) < 10 {
				return bodies, endTruncated
			}
			return bodies, endMalformed
		}
		if size > uint64(maxBytes) {
			return bodies, endTooLarge
		}
		data = data[n:]
		if uint64(len(data)) < size {
			return bodies, endTruncated
		}
		bodies = append(bodies, data[:size])
		data = data[size:]
	}
}

func endOf(err error) (streamEnd, bool) {
	switch {
	case err == io.EOF:
		return endEOF, true
	case errors.Is(err, executor.ErrTruncatedFrame):
		return endTruncated, true
	case errors.Is(err, executor.ErrMalformedFrame):
		return endMalformed, true
	case errors.Is(err, executor.ErrFrameTooLarge):
		var tl *executor.FrameTooLargeError
		return endTooLarge, errors.As(err, &tl) && tl.MaxSize == fuzzCap && tl.Size > fuzzCap
	}
	return 0, false
}

// smallReader reads frames from b through a small buffer (the default one,
// 64 KiB, would make each fuzzing run allocate megabytes).
func smallReader(b []byte) *executor.FrameReader {
	return executor.NewFrameReader(bufio.NewReaderSize(bytes.NewReader(b), 16), fuzzCap)
}

// FuzzReadFrame checks the frame reader against the reference model on any
// bytes: the same bodies, the same end (clean EOF, truncated, malformed, too
// large), whatever the underlying reader's read sizes; and that every body
// that decodes as a frame re-encodes into a frame that reads back equal.
//
// Seeds: every golden file of proto/golden (run on each `go test`), the hand
// written edge cases of testdata/fuzz/FuzzReadFrame, and what earlier fuzzing
// found there. Fuzz with
//
//	go test -fuzz=FuzzReadFrame -fuzztime=30s ./executor/
func FuzzReadFrame(f *testing.F) {
	golden, err := filepath.Glob(filepath.Join("..", "..", "proto", "golden", "*.bin"))
	if err != nil || len(golden) == 0 {
		f.Fatalf("no golden frames in ../../proto/golden (%v)", err)
	}
	for _, path := range golden {
		b, err := os.ReadFile(path)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
		f.Add(b[:len(b)-1]) // cut inside the last body
	}

	f.Fuzz(checkFrames)
}

// checkFrames is FuzzReadFrame's property.
func checkFrames(t *testing.T, data []byte) {
	wantBodies, wantEnd := referenceFrames(data, fuzzCap)
	var src io.Reader = bytes.NewReader(data)
	if len(data)%2 == 1 {
		src = iotest.OneByteReader(src) // short reads must not matter
	}
	fr := executor.NewFrameReader(src, fuzzCap)
	for i := 0; ; i++ {
		body, err := fr.ReadBody()
		if err != nil {
			end, ok := endOf(err)
			if !ok || end != wantEnd || i != len(wantBodies) {
				t.Fatalf("after %d frames: %v; the reference model has %d frames, end %d", i, err, len(wantBodies), wantEnd)
			}
			break
		}
		if i >= len(wantBodies) || !bytes.Equal(body, wantBodies[i]) {
			t.Fatalf("frame %d: body %x differs from the reference model's", i, body)
		}
	}

	// Read decodes each body as proto.Unmarshal does, or says
	// ErrMalformedFrame.
	for i, body := range wantBodies {
		for _, m := range []proto.Message{&pb.SupervisorFrame{}, &pb.ExecutorFrame{}} {
			want := m.ProtoReflect().New().Interface()
			decodes := proto.Unmarshal(body, want) == nil
			err := smallReader(protowire.AppendBytes(nil, body)).Read(m)
			if decodes != (err == nil) || (!decodes && !errors.Is(err, executor.ErrMalformedFrame)) {
				t.Fatalf("frame %d as %T: Read = %v, proto.Unmarshal ok = %v", i, m, err, decodes)
			}
			if !decodes {
				continue
			}
			// Re-encode and read back: equal (unknown fields included).
			re, err := executor.MarshalFrame(m)
			if err != nil {
				t.Fatalf("frame %d as %T: MarshalFrame: %v", i, m, err)
			}
			back := m.ProtoReflect().New().Interface()
			if err := smallReader(re).Read(back); err != nil || !proto.Equal(back, m) {
				t.Fatalf("frame %d as %T: re-encoded frame reads back as %v (%v), want %v", i, m, back, err, m)
			}
		}
	}
}
