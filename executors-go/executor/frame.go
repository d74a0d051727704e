package executor

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"sync"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// DefaultMaxFrameBytes is the default cap on one frame's body (PROTOCOL.md: 8 MiB).
const DefaultMaxFrameBytes = 8 << 20

// maxVarintLen is the longest base-128 varint of a 64-bit value.
const maxVarintLen = 10

var (
	// ErrTruncatedFrame: the stream ended inside a length prefix or a body.
	ErrTruncatedFrame = errors.New("truncated frame")
	// ErrMalformedFrame: the bytes are not a valid frame (bad length prefix or an
	// undecodable message).
	ErrMalformedFrame = errors.New("malformed frame")
	// ErrFrameTooLarge: a frame's length is over the cap. Errors that match it with
	// errors.Is are *FrameTooLargeError values.
	ErrFrameTooLarge = errors.New("frame too large")
	// ErrCheckpointTooLarge: a checkpoint that would leave the next attempt's
	// job frame (this job's, with the checkpoint in place of the one it
	// carried) over the executor's own cap. The supervisor could not send that
	// job, so every later attempt would fail JOB_TOO_LARGE; the event is not
	// sent.
	ErrCheckpointTooLarge = errors.New("checkpoint too large for the next attempt's job frame")
)

// nextJobSlack is what a job frame may grow by between attempts besides its
// checkpoint and its paths (the attempt number's varint, the envelope's
// length prefix).
const nextJobSlack = 16

// pathRoom is what one local path of the job (its output directory, each
// input artifact's) may take on the next attempt: another worker's work_dir,
// or another kind of process, names it differently (re-check audit: 29 bytes
// more failed the next attempt JOB_TOO_LARGE). Linux's PATH_MAX.
const pathRoom = 4096

// checkpointFieldLen is the bytes Job.checkpoint (field 13) takes in an
// encoded job: tag, length and data; 0 when absent.
func checkpointFieldLen(present bool, n int) int {
	if !present {
		return 0
	}
	return 1 + protowire.SizeVarint(uint64(n)) + n
}

// FrameTooLargeError reports a frame whose length is over the cap. It matches
// ErrFrameTooLarge with errors.Is.
type FrameTooLargeError struct {
	Size    uint64 // the announced (reading) or encoded (writing) body length
	MaxSize int    // the cap
}

func (e *FrameTooLargeError) Error() string {
	return fmt.Sprintf("frame too large: %d bytes exceeds the cap of %d bytes", e.Size, e.MaxSize)
}

// Is makes errors.Is(err, ErrFrameTooLarge) true.
func (e *FrameTooLargeError) Is(target error) bool { return target == ErrFrameTooLarge }

// FrameReader reads varint-length-delimited protobuf frames.
//
// It checks each announced length against its cap before allocating the body,
// and tells a clean end of stream (io.EOF, exactly between frames) from a
// truncated frame (ErrTruncatedFrame).
type FrameReader struct {
	r   *bufio.Reader
	max int
}

// NewFrameReader returns a reader of frames of at most maxFrameBytes bytes each
// (DefaultMaxFrameBytes when maxFrameBytes <= 0).
func NewFrameReader(r io.Reader, maxFrameBytes int) *FrameReader {
	if maxFrameBytes <= 0 {
		maxFrameBytes = DefaultMaxFrameBytes
	}
	br, ok := r.(*bufio.Reader)
	if !ok {
		br = bufio.NewReaderSize(r, 64<<10)
	}
	return &FrameReader{r: br, max: maxFrameBytes}
}

// ReadBody reads one frame and returns its body bytes.
//
// It returns io.EOF only when the stream ends exactly between two frames. An
// error wrapping ErrTruncatedFrame, ErrMalformedFrame or a *FrameTooLargeError
// describes a broken stream; any other error comes from the underlying reader.
func (fr *FrameReader) ReadBody() ([]byte, error) {
	var size uint64
	for i := 0; ; i++ {
		if i == maxVarintLen {
			return nil, fmt.Errorf("%w: length prefix longer than %d bytes", ErrMalformedFrame, maxVarintLen)
		}
		b, err := fr.r.ReadByte()
		if err != nil {
			if err == io.EOF {
				if i == 0 {
					return nil, io.EOF
				}
				return nil, fmt.Errorf("%w: stream ended after %d byte(s) of the length prefix", ErrTruncatedFrame, i)
			}
			return nil, err
		}
		if i == maxVarintLen-1 && b > 1 {
			return nil, fmt.Errorf("%w: length prefix overflows 64 bits", ErrMalformedFrame)
		}
		size |= uint64(b&0x7f) << (7 * i)
		if b < 0x80 {
			break
		}
	}
	if size > uint64(fr.max) {
		return nil, &FrameTooLargeError{Size: size, MaxSize: fr.max}
	}
	body := make([]byte, size)
	if n, err := io.ReadFull(fr.r, body); err != nil {
		if err == io.EOF || err == io.ErrUnexpectedEOF {
			return nil, fmt.Errorf("%w: stream ended after %d of %d body bytes", ErrTruncatedFrame, n, size)
		}
		return nil, err
	}
	return body, nil
}

// Read reads one frame into m (see ReadBody for the errors).
func (fr *FrameReader) Read(m proto.Message) error {
	body, err := fr.ReadBody()
	if err != nil {
		return err
	}
	if err := proto.Unmarshal(body, m); err != nil {
		return fmt.Errorf("%w: %d-byte body is not a %s: %v", ErrMalformedFrame, len(body), m.ProtoReflect().Descriptor().FullName(), err)
	}
	return nil
}

// deterministic is the one marshaller every frame goes through: map entries are
// sorted so that the same message always has the same bytes (golden files).
var deterministic = proto.MarshalOptions{Deterministic: true}

// MarshalFrame encodes m deterministically and prefixes it with its length.
func MarshalFrame(m proto.Message) ([]byte, error) {
	return appendFrame(nil, m, 0)
}

// appendFrame appends the frame of m to b, failing with a *FrameTooLargeError
// when the body would exceed maxBytes (no limit when maxBytes <= 0).
func appendFrame(b []byte, m proto.Message, maxBytes int) ([]byte, error) {
	size := deterministic.Size(m)
	if maxBytes > 0 && size > maxBytes {
		return nil, &FrameTooLargeError{Size: uint64(size), MaxSize: maxBytes}
	}
	b = protowire.AppendVarint(b, uint64(size))
	b, err := deterministic.MarshalAppend(b, m)
	if err != nil {
		return nil, fmt.Errorf("marshal %s: %w", m.ProtoReflect().Descriptor().FullName(), err)
	}
	return b, nil
}

// writeLimit is the cap on a job's frames: the executor's own cap, lowered to
// the supervisor's limit stated in the job (0 = not stated: a 1.0 supervisor,
// whose cap is the default).
func writeLimit(own int, supervisor uint64) int {
	if supervisor > 0 && supervisor < uint64(own) {
		return int(supervisor)
	}
	return own
}

// frameWriter serialises frames onto the frame stream. Each frame goes out in a
// single Write under the mutex, so concurrent senders never interleave bytes.
// The first write error is sticky: the stream is broken from then on.
type frameWriter struct {
	mu  sync.Mutex
	w   io.Writer
	max int
	err error
}

// errOutputBroken wraps the write error that broke the frame stream.
var errOutputBroken = errors.New("frame stream broken")

func (fw *frameWriter) write(m proto.Message) error {
	return fw.writeMax(m, fw.max)
}

// writeMax writes m unless its body is over maxBytes (a *FrameTooLargeError).
func (fw *frameWriter) writeMax(m proto.Message, maxBytes int) error {
	b, err := appendFrame(nil, m, maxBytes)
	if err != nil {
		return err // too large or unmarshalable: the stream itself is still fine
	}
	return fw.writeRaw(b)
}

func (fw *frameWriter) writeRaw(b []byte) error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	if fw.err != nil {
		return fw.err
	}
	if _, err := fw.w.Write(b); err != nil {
		fw.err = fmt.Errorf("%w: %w", errOutputBroken, err)
		return fw.err
	}
	return nil
}

func (fw *frameWriter) broken() error {
	fw.mu.Lock()
	defer fw.mu.Unlock()
	return fw.err
}
