//! Artifacts cross steps and languages: a Go step writes one, a Python step
//! that depends on it receives it as an input artifact, derives a new one from
//! it, and the lineage, sizes and hashes are what the bytes say.

use std::time::Duration;

use serde_json::json;
use sha2::{Digest, Sha256};
use tests::{fast_config, go_demo, python_demo, RunningWorker, TestDb};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn artifacts_flow_between_steps_with_lineage() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(5).await,
        fast_config(vec![go_demo("go", &[], None), python_demo("py", &[], None)]),
    )
    .await;
    let run = t
        .submit(json!({"name": "lineage", "steps": [
            {"name": "make", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "raw.txt", "content": "abc", "repeat": 2}},
            {"name": "derive", "executor_kind": "python", "kind": "demo.artifact",
             "input": {"name": "derived.txt", "content": "XYZ"}, "depends_on": ["make"]}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(
        st.state,
        "succeeded",
        "{}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );

    let make = &tests::step(&st, "make").artifacts;
    let derive = &tests::step(&st, "derive").artifacts;
    assert_eq!((make.len(), derive.len()), (1, 1));
    let (raw, derived) = (&make[0], &derive[0]);
    let expect_raw = b"abcabc".to_vec();
    let mut expect_derived = expect_raw.clone();
    expect_derived.extend_from_slice(b"XYZ");
    assert_eq!(raw.name, "raw.txt");
    assert_eq!(raw.size, expect_raw.len() as i64);
    assert_eq!(raw.sha256, hex(&expect_raw));
    assert_eq!(derived.size, expect_derived.len() as i64);
    assert_eq!(
        derived.sha256,
        hex(&expect_derived),
        "derived = input bytes + content"
    );

    let stored: Vec<u8> =
        sqlx::query_scalar("SELECT content FROM durable.artifact_blobs WHERE sha256 = $1")
            .bind(&derived.sha256)
            .fetch_one(t.db.pool())
            .await
            .expect("blob");
    assert_eq!(stored, expect_derived);
    let lineage: Vec<uuid::Uuid> = sqlx::query_scalar(
        "SELECT derived_from_id FROM durable.artifact_lineage WHERE artifact_id = $1",
    )
    .bind(derived.id)
    .fetch_all(t.db.pool())
    .await
    .expect("lineage");
    assert_eq!(
        lineage,
        vec![raw.id],
        "the derived artifact names its input"
    );
    w.shutdown().await;
}

fn hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_over_the_cap_fails_the_attempt_before_it_is_read() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.max_artifact_bytes = 64;
    let w = RunningWorker::start(t.connect(5).await, cfg).await;
    let run = t
        .submit(json!({"name": "big", "steps": [
            {"name": "make", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "big.txt", "content": "0123456789", "repeat": 10}}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    let s = tests::step(&st, "make");
    assert_eq!(s.state, "terminal_failed");
    let e = s.error.as_ref().expect("error");
    assert_eq!(e.code, "ARTIFACT_INVALID");
    assert!(
        e.message.contains("max_artifact_bytes is 64"),
        "{}",
        e.message
    );
    assert!(s.artifacts.is_empty());
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.artifact_blobs")
            .await,
        0
    );
    w.shutdown().await;
}

/// A run of two Python steps, `make` then `read`, whose handlers are the
/// script's `make(job)` and `read(job)`: the run must succeed, and `read`'s
/// output is returned.
async fn make_then_read(handlers: &str) -> serde_json::Value {
    let _serial = tests::exclusive().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let script = dir.path().join("steps.py");
    std::fs::write(
        &script,
        format!(
            "import json, sys\nfrom durable_executor import Executor, Result\n{handlers}\n\
             ex = Executor(\"python\", {{}})\nex.add_handler(\"t.make\", make)\n\
             ex.add_handler(\"t.read\", read)\nsys.exit(ex.run())\n"
        ),
    )
    .expect("script");
    let mut cfg = python_demo("steps", &[], None);
    cfg.args = vec![script.to_string_lossy().into_owned()];
    cfg.kinds = None;
    let t = TestDb::new().await;
    let mut config = fast_config(vec![cfg]);
    // a refused step fails at once, not after five rounds
    config.max_refusals = 1;
    let w = RunningWorker::start(t.connect(5).await, config).await;
    let run = t
        .submit(json!({"name": "steps", "steps": [
            {"name": "make", "executor_kind": "python", "kind": "t.make"},
            {"name": "read", "executor_kind": "python", "kind": "t.read", "depends_on": ["make"]}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    assert_eq!(
        st.state,
        "succeeded",
        "{}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    tests::step(&st, "read").output.clone().expect("output")
}

/// A step's artifacts whose names sanitize alike (`x/y` and `x_y` are both
/// `x_y` on disk) each reach the next step as a file of its own: the second
/// was refused `WORK_DIR_UNAVAILABLE` ("File exists") on every worker, so
/// the dependent step could never start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_whose_names_sanitize_alike_both_arrive() {
    let got = make_then_read(
        r#"
def make(job):
    entries = []
    for file, name, text in (("a.txt", "x/y", "one;"), ("b.txt", "x_y", "two;"), ("c.txt", "x?y", "three;")):
        with open(job.output_path(file), "w") as f:
            f.write(text)
        entries.append(job.artifact(file, name=name, media_type="text/plain"))
    return Result({}, entries)

def read(job):
    got = {}
    for ref in job.input_artifacts:
        with open(ref.path) as f:
            got[ref.name] = [ref.path.rsplit("/", 1)[-1], f.read()]
    return got
"#,
    )
    .await;
    let mut files = Vec::new();
    for (name, text) in [("x/y", "one;"), ("x_y", "two;"), ("x?y", "three;")] {
        assert_eq!(got[name][1], text, "{name}: its own bytes; all: {got}");
        files.push(got[name][0].as_str().unwrap_or_default().to_string());
    }
    files.sort();
    assert_eq!(
        files,
        ["x_y", "x_y~2", "x_y~3"],
        "each input in a file of its own: {got}"
    );
}

/// An artifact whose name is longer than a file name may be (300 bytes)
/// arrives downstream, under a name cut short. Before, every worker refused
/// the downstream step (`WORK_DIR_UNAVAILABLE`: "File name too long") until
/// it failed `EXECUTOR_REFUSED`, though the artifact had been accepted and
/// stored (security and DAG audits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_whose_name_is_too_long_for_a_file_arrives() {
    let got = make_then_read(
        r#"
def make(job):
    entries = []
    for file, name in (("a.txt", "n" * 300 + ".txt"), ("b.txt", "n" * 301 + ".txt")):
        with open(job.output_path(file), "w") as f:
            f.write(file)
        entries.append(job.artifact(file, name=name, media_type="text/plain"))
    return Result({}, entries)

def read(job):
    got = {}
    for ref in job.input_artifacts:
        with open(ref.path) as f:
            got[str(len(ref.name))] = [ref.path.rsplit("/", 1)[-1], f.read()]
    return got
"#,
    )
    .await;
    let cut = format!("{}.txt", "n".repeat(196));
    assert_eq!(got["304"], json!([cut, "a.txt"]), "{got}");
    assert_eq!(
        got["305"],
        json!([format!("{}~2.txt", "n".repeat(196)), "b.txt"]),
        "{got}"
    );
}
