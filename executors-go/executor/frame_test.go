package executor

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"runtime"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

func sampleFrames() []*pb.ExecutorFrame {
	f := 0.25
	return []*pb.ExecutorFrame{
		{Frame: &pb.ExecutorFrame_Hello{Hello: &pb.Hello{ExecutorKind: "go", Labels: map[string]string{"b": "2", "a": "1", "c": "3"}}}},
		{Frame: &pb.ExecutorFrame_Event{Event: &pb.ProgressEvent{JobId: "j", Sequence: 1, Fraction: &f, Checkpoint: []byte{}}}},
		{Frame: &pb.ExecutorFrame_Result{Result: &pb.JobResult{JobId: "j", Sequence: 2, Output: bytes.Repeat([]byte("x"), 300)}}},
		{}, // an empty frame is a zero-length body
	}
}

func TestFrameRoundTripAndProtodelimCompatibility(t *testing.T) {
	var stream []byte
	for _, f := range sampleFrames() {
		b, err := MarshalFrame(f)
		if err != nil {
			t.Fatal(err)
		}
		// Same bytes as protodelim with deterministic marshalling.
		var ref bytes.Buffer
		if _, err := (protodelim.MarshalOptions{MarshalOptions: proto.MarshalOptions{Deterministic: true}}).MarshalTo(&ref, f); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, ref.Bytes()) {
			t.Fatalf("MarshalFrame differs from protodelim:\n%x\n%x", b, ref.Bytes())
		}
		stream = append(stream, b...)
	}
	// Deterministic: map entries sorted, so two encodings are identical.
	again, _ := MarshalFrame(sampleFrames()[0])
	first, _ := MarshalFrame(sampleFrames()[0])
	if !bytes.Equal(again, first) {
		t.Fatal("MarshalFrame is not deterministic")
	}

	fr := NewFrameReader(bytes.NewReader(stream), 0)
	for i, want := range sampleFrames() {
		got := &pb.ExecutorFrame{}
		if err := fr.Read(got); err != nil {
			t.Fatalf("frame %d: %v", i, err)
		}
		if !proto.Equal(got, want) {
			t.Fatalf("frame %d: got %v want %v", i, got, want)
		}
	}
	if err := fr.Read(&pb.ExecutorFrame{}); err != io.EOF {
		t.Fatalf("after the last frame: %v, want io.EOF", err)
	}
	// protodelim reads what we write.
	br := bufio.NewReader(bytes.NewReader(stream))
	for i := range sampleFrames() {
		if err := protodelim.UnmarshalFrom(br, &pb.ExecutorFrame{}); err != nil {
			t.Fatalf("protodelim frame %d: %v", i, err)
		}
	}
}

func TestFrameReaderErrors(t *testing.T) {
	valid, _ := MarshalFrame(&pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Hello{Hello: &pb.Hello{ExecutorKind: "go"}}})
	cases := []struct {
		name  string
		input []byte
		want  error
		text  string
	}{
		{"empty stream is a clean EOF", nil, io.EOF, ""},
		{"truncated length prefix", []byte{0x80}, ErrTruncatedFrame, "1 byte(s) of the length prefix"},
		{"truncated body", []byte{5, 1, 2}, ErrTruncatedFrame, "2 of 5 body bytes"},
		{"truncated second frame", append(append([]byte{}, valid...), valid[:len(valid)-1]...), ErrTruncatedFrame, "body bytes"},
		{"varint longer than 10 bytes", bytes.Repeat([]byte{0x80}, 11), ErrMalformedFrame, "overflows"},
		{"varint overflowing 64 bits", append(bytes.Repeat([]byte{0xff}, 9), 0x02), ErrMalformedFrame, "overflows"},
		{"undecodable body", []byte{2, 0xff, 0xff}, ErrMalformedFrame, "not a durable.executor.v1.ExecutorFrame"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fr := NewFrameReader(bytes.NewReader(c.input), 0)
			var err error
			for err == nil {
				err = fr.Read(&pb.ExecutorFrame{})
			}
			if c.want == io.EOF {
				if err != io.EOF {
					t.Fatalf("got %v, want exactly io.EOF", err)
				}
				return
			}
			if !errors.Is(err, c.want) || errors.Is(err, io.EOF) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if !strings.Contains(err.Error(), c.text) {
				t.Fatalf("error %q does not mention %q", err, c.text)
			}
		})
	}
}

func TestOversizeFrameRejectedBeforeAllocating(t *testing.T) {
	// A header announcing 2^62 bytes: allocating it would panic or exhaust memory.
	huge := protowire.AppendVarint(nil, 1<<62)
	var tl *FrameTooLargeError
	err := NewFrameReader(bytes.NewReader(huge), 0).Read(&pb.SupervisorFrame{})
	if !errors.As(err, &tl) || tl.Size != 1<<62 || tl.MaxSize != DefaultMaxFrameBytes || !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("got %v, want FrameTooLargeError{2^62, 8 MiB}", err)
	}

	// A header announcing 64 MiB followed by a few bytes: rejected without
	// allocating anything near the announced size.
	stream := append(protowire.AppendVarint(nil, 64<<20), "some bytes"...)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fr := NewFrameReader(bytes.NewReader(stream), 0)
	err = fr.Read(&pb.SupervisorFrame{})
	runtime.ReadMemStats(&after)
	if !errors.As(err, &tl) || tl.Size != 64<<20 {
		t.Fatalf("got %v, want FrameTooLargeError{64 MiB}", err)
	}
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 1<<20 {
		t.Fatalf("reading an oversize header allocated %d bytes", grew)
	}

	// The cap is inclusive.
	exact := append(protowire.AppendVarint(nil, 16), make([]byte, 16)...)
	if _, err := NewFrameReader(bytes.NewReader(exact), 16).ReadBody(); err != nil {
		t.Fatalf("a frame of exactly the cap: %v", err)
	}
	if _, err := NewFrameReader(bytes.NewReader(exact), 15).ReadBody(); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("a frame one byte over the cap: %v", err)
	}
}

func TestFrameWriterRejectsOversizeAndStaysUsable(t *testing.T) {
	var buf bytes.Buffer
	fw := &frameWriter{w: &buf, max: 64}
	big := &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Result{Result: &pb.JobResult{Output: make([]byte, 100)}}}
	if err := fw.write(big); !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("write of a 100+ byte frame with cap 64: %v", err)
	}
	if buf.Len() != 0 {
		t.Fatalf("an oversize frame wrote %d bytes", buf.Len())
	}
	if err := fw.write(&pb.ExecutorFrame{}); err != nil || fw.broken() != nil {
		t.Fatalf("writer unusable after an oversize frame: %v", err)
	}
}
