package executor

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"google.golang.org/protobuf/reflect/protoreflect"

	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// wireText is s as the wire accepts it: invalid UTF-8 (protobuf refuses to
// encode it in a string field, so the frame would not go out at all) and NUL
// (the supervisor refuses it in an event message or an error's code or
// message: PROTOCOL_INVALID_TEXT) become U+FFFD. Text the SDK sends there,
// the handler's included, goes through it (the Python SDK does the same).
func wireText(s string) string {
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// invalidUTF8Fields lists the string fields of m (nested messages, lists
// and maps included) that hold invalid UTF-8, as paths such as
// "result.artifacts[1].path": protobuf's own error does not say which.
func invalidUTF8Fields(m protoreflect.Message) []string {
	var bad []string
	var walk func(m protoreflect.Message, prefix string)
	check := func(fd protoreflect.FieldDescriptor, v protoreflect.Value, path string) {
		switch fd.Kind() {
		case protoreflect.StringKind:
			if !utf8.ValidString(v.String()) {
				bad = append(bad, path)
			}
		case protoreflect.MessageKind, protoreflect.GroupKind:
			walk(v.Message(), path+".")
		}
	}
	walk = func(m protoreflect.Message, prefix string) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			path := prefix + string(fd.Name())
			switch {
			case fd.IsList():
				l := v.List()
				for i := 0; i < l.Len(); i++ {
					check(fd, l.Get(i), fmt.Sprintf("%s[%d]", path, i))
				}
			case fd.IsMap():
				v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
					key := k.String()
					if !utf8.ValidString(key) {
						bad = append(bad, path+" (a key)")
						key = strings.ToValidUTF8(key, "\uFFFD")
					}
					check(fd.MapValue(), mv, fmt.Sprintf("%s[%q]", path, key))
					return true
				})
			default:
				check(fd, v, path)
			}
			return true
		})
	}
	walk(m, "")
	return bad
}

// unencodableTerminal replaces a terminal frame that cannot be encoded (err
// is why) with a JobError that can, with the same sequence: the job still
// ends with its one terminal. A result becomes OUTPUT_INVALID (not
// retryable: the same result would fail the same way); an error becomes
// HANDLER_ERROR, retryable as the handler said. The message names the
// fields at fault. Everything in it is valid text of bounded size.
func unencodableTerminal(jobID string, seq uint64, f *pb.ExecutorFrame, err error) *pb.ExecutorFrame {
	code, retryable, what := CodeOutputInvalid, false, "result"
	if e := f.GetError(); e != nil {
		code, retryable, what = CodeHandlerError, e.GetRetryable(), "error (code "+wireText(e.GetCode())+")"
	}
	message := fmt.Sprintf("the job's %s could not be encoded as a frame: %v", what, err)
	if fields := invalidUTF8Fields(f.ProtoReflect()); len(fields) > 0 {
		message += "; invalid UTF-8 in " + strings.Join(fields, ", ")
	}
	return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: &pb.JobError{
		JobId:     wireText(jobID),
		Sequence:  seq,
		Code:      code,
		Message:   truncateUTF8(wireText(message), 1024),
		Retryable: retryable,
	}}}
}

// checkArtifactText refuses a manifest entry whose text cannot go on the
// wire (an artifact is named by its path: replacing bytes would name
// another file), and a path with NUL, which no file has.
func checkArtifactText(a Artifact) error {
	fields := []struct{ name, value string }{{"name", a.Name}, {"path", a.Path}, {"sha256", a.SHA256}, {"media type", a.MediaType}}
	for i, d := range a.DerivedFrom {
		fields = append(fields, struct{ name, value string }{fmt.Sprintf("derived_from[%d]", i), d})
	}
	for _, f := range fields {
		if !utf8.ValidString(f.value) {
			return fmt.Errorf("its %s %q is not valid UTF-8", f.name, f.value)
		}
	}
	if strings.IndexByte(a.Path, 0) >= 0 {
		return fmt.Errorf("its path %q contains NUL", a.Path)
	}
	return nil
}
