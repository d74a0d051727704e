//! The golden frames of proto/golden, written by the Go generator and checked
//! by the Go and Python tests too: prost decodes every frame and re-encodes
//! the stream byte for byte.

use std::path::Path;

use bytes::BytesMut;
use prost::Message;
use supervisor::wire::{pb, FrameDecoder};
use tokio_util::codec::Decoder;

fn frames<M: Message + Default>(bytes: &[u8]) -> Vec<M> {
    let mut d = FrameDecoder::<M>::new(1 << 24);
    let mut buf = BytesMut::from(bytes);
    let mut out = Vec::new();
    while let Some(m) = d.decode_eof(&mut buf).expect("golden frame decodes") {
        out.push(m);
    }
    out
}

#[test]
fn golden_frames_round_trip_byte_for_byte() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden");
    let mut checked = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("proto/golden")
        .flatten()
        .collect();
    entries.sort_by_key(|e| e.path());
    for e in entries {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("bin") {
            continue;
        }
        let bin = std::fs::read(&path).expect("bin");
        let meta: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path.with_extension("json")).expect("json pair"))
                .expect("json");
        let expected = meta["frames"].as_array().expect("frames").len();
        let reencoded: Vec<u8> = match meta["direction"].as_str() {
            Some("supervisor_to_executor") => {
                let f = frames::<pb::SupervisorFrame>(&bin);
                assert_eq!(f.len(), expected, "{}", path.display());
                assert!(f.iter().all(|m| m.frame.is_some()));
                f.iter()
                    .flat_map(|m| m.encode_length_delimited_to_vec())
                    .collect()
            }
            Some("executor_to_supervisor") => {
                let f = frames::<pb::ExecutorFrame>(&bin);
                assert_eq!(f.len(), expected, "{}", path.display());
                assert!(f.iter().all(|m| m.frame.is_some()));
                f.iter()
                    .flat_map(|m| m.encode_length_delimited_to_vec())
                    .collect()
            }
            other => panic!("{}: unknown direction {other:?}", path.display()),
        };
        assert_eq!(
            reencoded,
            bin,
            "{} does not re-encode byte for byte",
            path.display()
        );
        checked += 1;
    }
    assert!(
        checked >= 10,
        "only {checked} golden files found in {}",
        dir.display()
    );
    println!("{checked} golden files round-trip");
}

#[test]
fn golden_job_fields_decode_as_the_json_says() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden");
    let bin = std::fs::read(dir.join("job_full.bin")).expect("job_full.bin");
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("job_full.json")).expect("json"))
            .expect("json");
    let f = frames::<pb::SupervisorFrame>(&bin);
    let Some(pb::supervisor_frame::Frame::Job(job)) = &f[0].frame else {
        panic!("job_full is not a job");
    };
    let j = &meta["frames"][0]["job"];
    assert_eq!(job.job_id, j["job_id"].as_str().expect("job_id"));
    assert_eq!(
        job.idempotency_key,
        j["idempotency_key"].as_str().expect("key")
    );
    assert_eq!(job.kind, j["kind"].as_str().expect("kind"));
    assert_eq!(job.attempt as u64, j["attempt"].as_u64().expect("attempt"));
    assert_eq!(
        job.secrets.len(),
        j["secrets"].as_object().expect("secrets").len()
    );
    assert_eq!(
        job.input_artifacts.len(),
        j["input_artifacts"].as_array().expect("artifacts").len()
    );
    assert!(job.checkpoint.is_some());
}
