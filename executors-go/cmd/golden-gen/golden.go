package main

import (
	"bytes"
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

// Directions, as written in each .json file.
const (
	supervisorToExecutor = "supervisor_to_executor" // frames are SupervisorFrames
	executorToSupervisor = "executor_to_supervisor" // frames are ExecutorFrames
)

// golden is one pair of files: <name>.bin and <name>.json.
type golden struct {
	name      string
	direction string
	frames    []proto.Message
}

// fixed timestamps keep the files byte-stable.
const (
	at0      = int64(1767225600000) // 2026-01-01T00:00:00Z
	deadline = int64(1767229200000)
)

func ptr[T any](v T) *T { return &v }

func s2e(f any) proto.Message {
	switch f := f.(type) {
	case *pb.Job:
		return &pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Job{Job: f}}
	case *pb.Cancel:
		return &pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Cancel{Cancel: f}}
	case *pb.Shutdown:
		return &pb.SupervisorFrame{Frame: &pb.SupervisorFrame_Shutdown{Shutdown: f}}
	}
	panic(fmt.Sprintf("not a supervisor frame: %T", f))
}

func e2s(f any) proto.Message {
	switch f := f.(type) {
	case *pb.Hello:
		return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Hello{Hello: f}}
	case *pb.ProgressEvent:
		return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Event{Event: f}}
	case *pb.JobResult:
		return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Result{Result: f}}
	case *pb.JobError:
		return &pb.ExecutorFrame{Frame: &pb.ExecutorFrame_Error{Error: f}}
	}
	panic(fmt.Sprintf("not an executor frame: %T", f))
}

func hello() *pb.Hello {
	return &pb.Hello{
		ProtocolVersion:   pb.ProtocolVersion_PROTOCOL_VERSION_1,
		ExecutorKind:      "go",
		Kinds:             []string{"demo.echo", "demo.sleep"},
		Labels:            map[string]string{"region": "eu-west", "gpu": "a100", "arch": "amd64"},
		SdkName:           executor.SDKName,
		SdkVersion:        "0.1.0", // a fixed example value: the golden files must not change with each release of the SDK
		MaxJobsPerProcess: -1,
		Pid:               4242,
	}
}

func fullJob() *pb.Job {
	return &pb.Job{
		JobId:                 "job-01HZX3",
		WorkflowRunId:         "wr-7f3a",
		StepRunId:             "sr-9c21",
		IdempotencyKey:        "wr-7f3a/resize",
		ExecutorKind:          "go",
		Kind:                  "demo.artifact",
		Attempt:               2,
		DeadlineUnixMs:        deadline,
		AttemptDeadlineUnixMs: at0 + 60_000,
		HeartbeatTimeoutMs:    30_000,
		Input:                 []byte(`{"content":"héllo ✓","name":"out.txt","repeat":2}`),
		InputArtifacts: []*pb.ArtifactRef{
			{Id: "art-a", Name: "raw", Sha256: "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824", Size: 5,
				MediaType: "text/plain", Path: "/var/lib/durable/artifacts/art-a", StepName: "fetch"},
			{Id: "art-b", Name: "meta", Sha256: "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", Size: 2,
				MediaType: "application/json", Path: "/var/lib/durable/artifacts/art-b", StepName: "describe"},
		},
		Checkpoint: []byte("\x00\x01resume@42\xff"),
		OutputDir:  "/var/lib/durable/runs/wr-7f3a/sr-9c21/attempt-2",
		Secrets:    map[string]string{"DB_PASSWORD": "pw-456", "API_TOKEN": "tok-123"},
		Labels:     map[string]string{"region": "eu-west", "gpu": "a100"},
		// protocol 1.1: what the supervisor chose for a negotiating hello
		NegotiatedVersion:  "1.1",
		NegotiatedFeatures: []string{"frame_limits"},
		MaxFrameBytes:      8 << 20,
	}
}

// negotiatingHello is a protocol 1.1 hello: revisions, features (one the
// supervisor does not know) and a frame limit over 2^21 (a 4-byte varint).
func negotiatingHello() *pb.Hello {
	h := hello()
	h.ProtocolVersions = []string{"1.0", "1.1"}
	h.Features = []string{"frame_limits", "x-unknown"}
	h.MaxFrameBytes = 16 << 20
	return h
}

func emptyCheckpointJob() *pb.Job {
	return &pb.Job{
		JobId:          "job-02",
		WorkflowRunId:  "wr-7f3a",
		StepRunId:      "sr-9c22",
		IdempotencyKey: "wr-7f3a/resume",
		ExecutorKind:   "go",
		Kind:           "demo.echo",
		Attempt:        3,
		Input:          []byte(`null`),
		Checkpoint:     []byte{}, // present but empty: not the same as absent
		OutputDir:      "/tmp/out",
	}
}

func event(seq uint64, kind pb.EventKind) *pb.ProgressEvent {
	return &pb.ProgressEvent{JobId: "job-01HZX3", Sequence: seq, Kind: kind, AtUnixMs: at0 + int64(seq)*250}
}

func progress() *pb.ProgressEvent {
	e := event(3, pb.EventKind_EVENT_KIND_PROGRESS)
	e.Message, e.Fraction, e.Checkpoint = "resized 1 of 2", ptr(0.5), []byte("page=1")
	return e
}

func heartbeatWithCheckpoint() *pb.ProgressEvent {
	e := event(4, pb.EventKind_EVENT_KIND_HEARTBEAT)
	e.Checkpoint = []byte("page=2")
	return e
}

func result() *pb.JobResult {
	return &pb.JobResult{
		JobId:    "job-01HZX3",
		Sequence: 5,
		Output:   []byte(`{"name":"out.txt","sha256":"9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08","size":4}`),
		Artifacts: []*pb.ArtifactManifestEntry{
			{Name: "out.txt", Path: "out.txt", Sha256: "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", Size: 4,
				MediaType: "text/plain", DerivedFrom: []string{"art-a", "art-b"}},
			{Name: "thumbnail", Path: "thumbs/small.png", Sha256: "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", Size: 0,
				MediaType: "image/png", DerivedFrom: []string{"art-a"}},
		},
	}
}

// goldens is the full set, in a stable order.
func goldens() []golden {
	zero := event(3, pb.EventKind_EVENT_KIND_PROGRESS)
	zero.Message, zero.Fraction, zero.Checkpoint = "starting", ptr(0.0), []byte{} // present zero values

	return []golden{
		{"hello", executorToSupervisor, []proto.Message{e2s(hello())}},
		{"hello_negotiating", executorToSupervisor, []proto.Message{e2s(negotiatingHello())}},
		{"job_full", supervisorToExecutor, []proto.Message{s2e(fullJob())}},
		{"job_empty_checkpoint", supervisorToExecutor, []proto.Message{s2e(emptyCheckpointJob())}},
		{"cancel", supervisorToExecutor, []proto.Message{s2e(&pb.Cancel{
			JobId: "job-01HZX3", Reason: pb.CancelReason_CANCEL_REASON_ATTEMPT_TIMEOUT, GraceMs: 5000, Message: "attempt timed out after 60000 ms",
		})}},
		{"shutdown", supervisorToExecutor, []proto.Message{s2e(&pb.Shutdown{Reason: "worker draining"})}},
		{"event_accepted", executorToSupervisor, []proto.Message{e2s(event(1, pb.EventKind_EVENT_KIND_ACCEPTED))}},
		{"event_running", executorToSupervisor, []proto.Message{e2s(event(2, pb.EventKind_EVENT_KIND_RUNNING))}},
		{"event_progress", executorToSupervisor, []proto.Message{e2s(progress())}},
		{"event_progress_zero_fraction", executorToSupervisor, []proto.Message{e2s(zero)}},
		{"event_heartbeat", executorToSupervisor, []proto.Message{e2s(heartbeatWithCheckpoint())}},
		{"result", executorToSupervisor, []proto.Message{e2s(result())}},
		{"error", executorToSupervisor, []proto.Message{e2s(&pb.JobError{
			JobId: "job-01HZX3", Sequence: 5, Code: "UPSTREAM_UNAVAILABLE", Message: "api.example.com answered 503",
			Retryable: true, Details: []byte(`{"host":"api.example.com","status":503}`), NextRetryDelayMs: ptr(uint64(1500)),
		})}},
		{"error_retry_now", executorToSupervisor, []proto.Message{e2s(&pb.JobError{
			JobId: "job-01HZX3", Sequence: 3, Code: "RATE_LIMITED", Message: "retry at once", Retryable: true,
			NextRetryDelayMs: ptr(uint64(0)), // present zero: "no backoff", not "use the policy"
		})}},
		{"refusal", executorToSupervisor, []proto.Message{e2s(&pb.JobError{
			JobId: "job-03", Sequence: 1, Code: "UNSUPPORTED_KIND", Message: `no handler for kind "demo.teleport" (this executor handles: demo.echo, demo.sleep)`,
		})}},
		{"conversation_executor", executorToSupervisor, []proto.Message{
			e2s(hello()),
			e2s(event(1, pb.EventKind_EVENT_KIND_ACCEPTED)),
			e2s(event(2, pb.EventKind_EVENT_KIND_RUNNING)),
			e2s(progress()),
			e2s(heartbeatWithCheckpoint()),
			e2s(result()),
		}},
		{"conversation_supervisor", supervisorToExecutor, []proto.Message{
			s2e(fullJob()),
			s2e(&pb.Cancel{JobId: "job-01HZX3", Reason: pb.CancelReason_CANCEL_REASON_REQUESTED, GraceMs: 10_000}),
			s2e(&pb.Shutdown{}),
		}},
	}
}

// encodeBin returns the frames as one delimited stream.
func encodeBin(frames []proto.Message) ([]byte, error) {
	var out []byte
	for _, f := range frames {
		b, err := executor.MarshalFrame(f)
		if err != nil {
			return nil, err
		}
		out = append(out, b...)
	}
	return out, nil
}

// goldenJSON is the layout of a .json file.
type goldenJSON struct {
	Direction string            `json:"direction"`
	Frames    []json.RawMessage `json:"frames"`
}

// encodeJSON returns the .json file: protojson with proto field names, map keys
// sorted, normalised to a stable two-space indentation (protojson output is
// deliberately unstable in its whitespace).
func encodeJSON(direction string, frames []proto.Message) ([]byte, error) {
	doc := goldenJSON{Direction: direction}
	for _, f := range frames {
		b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(f)
		if err != nil {
			return nil, err
		}
		var compact bytes.Buffer
		if err := json.Compact(&compact, b); err != nil {
			return nil, err
		}
		doc.Frames = append(doc.Frames, compact.Bytes())
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
