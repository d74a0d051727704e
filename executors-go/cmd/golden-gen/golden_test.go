package main

import (
	"bytes"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/durable-runtime/durable/executors-go/executor"
	pb "github.com/durable-runtime/durable/executors-go/gen/executorv1"
)

func goldenDir(t *testing.T) string {
	t.Helper()
	root, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return filepath.Join(root, "proto", "golden")
}

// TestGoldenFilesRoundTrip is what every language's suite does with the files:
// decode each .bin, compare each frame with the .json's protojson parse, and
// re-encode it deterministically to the same bytes.
func TestGoldenFilesRoundTrip(t *testing.T) {
	dir := goldenDir(t)
	bins, err := filepath.Glob(filepath.Join(dir, "*.bin"))
	if err != nil {
		t.Fatal(err)
	}
	jsons, _ := filepath.Glob(filepath.Join(dir, "*.json"))
	if len(bins) < 10 || len(bins) != len(jsons) {
		t.Fatalf("%d .bin and %d .json files in %s; want matching pairs", len(bins), len(jsons), dir)
	}
	for _, binPath := range bins {
		name := strings.TrimSuffix(filepath.Base(binPath), ".bin")
		t.Run(name, func(t *testing.T) {
			bin, err := os.ReadFile(binPath)
			if err != nil {
				t.Fatal(err)
			}
			js, err := os.ReadFile(filepath.Join(dir, name+".json"))
			if err != nil {
				t.Fatal(err)
			}
			var doc goldenJSON
			dec := json.NewDecoder(bytes.NewReader(js))
			dec.DisallowUnknownFields()
			if err := dec.Decode(&doc); err != nil {
				t.Fatalf("%s.json: %v", name, err)
			}
			var newFrame func() proto.Message
			switch doc.Direction {
			case supervisorToExecutor:
				newFrame = func() proto.Message { return &pb.SupervisorFrame{} }
			case executorToSupervisor:
				newFrame = func() proto.Message { return &pb.ExecutorFrame{} }
			default:
				t.Fatalf("direction %q", doc.Direction)
			}
			if len(doc.Frames) == 0 {
				t.Fatal("no frames")
			}

			fr := executor.NewFrameReader(bytes.NewReader(bin), 0)
			var reencoded []byte
			for i, raw := range doc.Frames {
				want := newFrame()
				if err := protojson.Unmarshal(raw, want); err != nil {
					t.Fatalf("frame %d: protojson: %v", i, err)
				}
				got := newFrame()
				if err := fr.Read(got); err != nil {
					t.Fatalf("frame %d: decoding the .bin: %v", i, err)
				}
				if !proto.Equal(got, want) {
					t.Fatalf("frame %d: .bin decodes to\n%v\n.json says\n%v", i, got, want)
				}
				b, err := executor.MarshalFrame(got)
				if err != nil {
					t.Fatal(err)
				}
				reencoded = append(reencoded, b...)
			}
			if err := fr.Read(newFrame()); err != io.EOF {
				t.Fatalf("after %d frames the .bin holds more: %v", len(doc.Frames), err)
			}
			if !bytes.Equal(reencoded, bin) {
				t.Fatalf("re-encoding differs from the file:\n got %x\nwant %x", reencoded, bin)
			}
		})
	}
}

// TestGoldenFilesAreUpToDate fails when proto/golden differs from what
// golden-gen writes (run `go run ./cmd/golden-gen` from executors-go/).
func TestGoldenFilesAreUpToDate(t *testing.T) {
	files, err := render()
	if err != nil {
		t.Fatal(err)
	}
	diffs, err := compare(goldenDir(t), files)
	if err != nil {
		t.Fatal(err)
	}
	if len(diffs) > 0 {
		t.Fatalf("proto/golden is out of date (run `go run ./cmd/golden-gen` from executors-go/):\n%s", strings.Join(diffs, "\n"))
	}
	// Rendering twice gives the same bytes (no map-order or whitespace noise).
	again, _ := render()
	for name, b := range files {
		if !bytes.Equal(b, again[name]) {
			t.Fatalf("%s is not rendered deterministically", name)
		}
	}
}

// TestGoldenCoverage pins the properties the other languages rely on the files
// to exercise.
func TestGoldenCoverage(t *testing.T) {
	byName := map[string]golden{}
	var names []string
	for _, g := range goldens() {
		byName[g.name] = g
		names = append(names, g.name)
	}
	sort.Strings(names)
	for _, must := range []string{"hello", "job_full", "job_empty_checkpoint", "cancel", "shutdown", "event_accepted",
		"event_running", "event_progress", "result", "error", "conversation_executor"} {
		if _, ok := byName[must]; !ok {
			t.Errorf("no golden %q (have %v)", must, names)
		}
	}
	job := byName["job_full"].frames[0].(*pb.SupervisorFrame).GetJob()
	if len(job.GetSecrets()) != 2 || len(job.GetLabels()) == 0 || job.Checkpoint == nil || len(job.GetInputArtifacts()) != 2 {
		t.Errorf("job_full lacks secrets/labels/checkpoint/artifacts: %v", job)
	}
	// Every field of Job is set.
	if n, want := countSet(job), job.ProtoReflect().Descriptor().Fields().Len(); n != want {
		t.Errorf("job_full sets %d of %d Job fields", n, want)
	}
	if cp := byName["job_empty_checkpoint"].frames[0].(*pb.SupervisorFrame).GetJob(); cp.Checkpoint == nil || len(cp.Checkpoint) != 0 {
		t.Errorf("job_empty_checkpoint: checkpoint %v", cp.Checkpoint)
	}
	ev := byName["event_progress"].frames[0].(*pb.ExecutorFrame).GetEvent()
	if ev.Fraction == nil || ev.Checkpoint == nil {
		t.Errorf("event_progress lacks fraction or checkpoint: %v", ev)
	}
	res := byName["result"].frames[0].(*pb.ExecutorFrame).GetResult()
	if len(res.GetArtifacts()) != 2 || len(res.GetArtifacts()[0].GetDerivedFrom()) == 0 {
		t.Errorf("result lacks 2 artifacts with derived_from: %v", res)
	}
	e := byName["error"].frames[0].(*pb.ExecutorFrame).GetError()
	if len(e.GetDetails()) == 0 || e.NextRetryDelayMs == nil {
		t.Errorf("error lacks details or next_retry_delay_ms: %v", e)
	}
	if n := len(byName["conversation_executor"].frames); n < 4 {
		t.Errorf("conversation_executor has %d frames", n)
	}
}

func countSet(m proto.Message) int {
	n := 0
	r := m.ProtoReflect()
	fields := r.Descriptor().Fields()
	for i := 0; i < fields.Len(); i++ {
		if r.Has(fields.Get(i)) {
			n++
		}
	}
	return n
}
