//! The artifact store's two backends (PostgreSQL chunks, a shared directory)
//! end to end: a three-step chain of multi-chunk artifacts (3 MiB in 64 KiB
//! chunks) round-trips byte-exact through `artifact get` with its whole
//! lineage; inputs arrive read-only; the same bytes are not stored twice; and
//! an executor whose manifest lies about sha256 or size fails with
//! ARTIFACT_DIGEST_MISMATCH leaving no artifact row, no blob, no chunk, no file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use supervisor::config::{ArtifactBackend, WorkerConfig};
use tests::{fast_config, go_demo, RunningWorker, TestDb};

const CHUNK: usize = 64 * 1024;

fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(tests::supervisor_bin())
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
        .env_remove("DURABLE_ARTIFACT_DIR")
        .stdin(Stdio::null())
        .output()
        .expect("run supervisor")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn config(backend: ArtifactBackend, dir: &Path, report: Option<&Path>) -> WorkerConfig {
    let mut exec = go_demo("go", &[], None);
    if let Some(report) = report {
        // what the executor finds in in/: each input's mode and name
        exec = tests::wrap_in_shell(
            exec,
            &format!(
                "for f in in/*/*; do [ -e \"$f\" ] && stat -c '%a %n' \"$f\" >> {}; done; exec \"$0\" \"$@\"",
                report.display()
            ),
        );
    }
    let mut cfg = fast_config(vec![exec]);
    cfg.artifact_store = backend;
    cfg.artifact_dir = Some(dir.to_owned());
    cfg.artifact_chunk_bytes = CHUNK;
    cfg
}

/// Every regular file below `dir`.
fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

async fn chain_round_trip(backend: ArtifactBackend) {
    let t = TestDb::new().await;
    let store_dir = tempfile::tempdir().expect("tempdir");
    let scratch = tempfile::tempdir().expect("tempdir");
    let report = scratch.path().join("modes.txt");
    let w = RunningWorker::start(
        t.connect(10).await,
        config(backend, store_dir.path(), Some(&report)),
    )
    .await;
    // a: 3 MiB (48 chunks of 64 KiB); b = a + "BBB"; c = b + 3000 bytes
    let run = t
        .submit(json!({"name": "chain", "steps": [
            {"name": "first", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "a.bin", "content": "0123456789abcdef", "repeat": 196608}},
            {"name": "second", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "b.bin", "content": "B", "repeat": 3}, "depends_on": ["first"]},
            {"name": "third", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "c.bin", "content": "xyz", "repeat": 1000}, "depends_on": ["second"]}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(90)).await;
    assert_eq!(
        st.state,
        "succeeded",
        "{backend:?}: {}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    let art = |step: &str| tests::step(&st, step).artifacts[0].clone();
    let (a, b, c) = (art("first"), art("second"), art("third"));
    let mut expect_c = "0123456789abcdef".repeat(196608).into_bytes();
    expect_c.extend_from_slice(b"BBB");
    expect_c.extend_from_slice("xyz".repeat(1000).as_bytes());
    assert_eq!(c.size, expect_c.len() as i64);
    assert_eq!(c.sha256, sha256_hex(&expect_c));

    // where the bytes are
    let blobs: Vec<(String, i64, String, Option<i32>)> = sqlx::query_as(
        "SELECT sha256, size, store, chunks FROM durable.artifact_blobs ORDER BY size",
    )
    .fetch_all(t.db.pool())
    .await
    .expect("blobs");
    assert_eq!(blobs.len(), 3, "{blobs:?}");
    let chunk_rows = t
        .scalar_i64("SELECT count(*) FROM durable.artifact_chunks")
        .await;
    match backend {
        ArtifactBackend::Postgres => {
            let mut want_rows = 0;
            for (sha, size, store, chunks) in &blobs {
                let want = (*size as usize).div_ceil(CHUNK) as i32;
                assert_eq!((store.as_str(), *chunks), ("chunks", Some(want)), "{sha}");
                want_rows += want as i64;
                let (n, bytes, largest): (i64, i64, i32) = sqlx::query_as(
                    "SELECT count(*), sum(octet_length(c.data))::bigint, max(octet_length(c.data))
                       FROM durable.artifact_chunks c
                       JOIN durable.artifact_blobs b ON b.upload_id = c.upload_id
                      WHERE b.sha256 = $1",
                )
                .bind(sha)
                .fetch_one(t.db.pool())
                .await
                .expect("chunks");
                assert_eq!((n, bytes), (want as i64, *size), "{sha}");
                assert_eq!(largest as usize, CHUNK, "no value above a chunk");
            }
            assert_eq!(chunk_rows, want_rows, "no chunk outside a blob");
        }
        ArtifactBackend::Directory => {
            assert_eq!(chunk_rows, 0);
            let files = files_below(store_dir.path());
            let mut want: Vec<PathBuf> = blobs
                .iter()
                .map(|(sha, ..)| store_dir.path().join(&sha[..2]).join(sha))
                .collect();
            want.sort();
            assert_eq!(files, want, "one file per blob, no .part left");
            for (sha, size, store, chunks) in &blobs {
                assert_eq!((store.as_str(), *chunks), ("directory", None));
                let p = store_dir.path().join(&sha[..2]).join(sha);
                let m = std::fs::metadata(&p).expect("blob file");
                use std::os::unix::fs::PermissionsExt;
                assert_eq!(
                    (m.len() as i64, m.permissions().mode() & 0o777),
                    (*size, 0o444)
                );
            }
        }
    }

    // inputs arrived read-only, each where the job said
    let modes = std::fs::read_to_string(&report).expect("mode report");
    let lines: Vec<&str> = modes.lines().collect();
    assert_eq!(lines.len(), 2, "{modes}");
    assert!(lines.iter().all(|l| l.starts_with("444 ")), "{modes}");
    assert!(lines[0].ends_with("in/first/a.bin"), "{modes}");
    assert!(lines[1].ends_with("in/second/b.bin"), "{modes}");

    // the whole lineage, c <- b <- a
    let out = cli(
        &t.url,
        &["artifact", "lineage", &c.id.to_string(), "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let j: Value = serde_json::from_slice(&out.stdout).expect("lineage JSON");
    let mut node = &j;
    for (want, step) in [(&c, "third"), (&b, "second"), (&a, "first")] {
        assert_eq!(node["id"], want.id.to_string(), "{j:#}");
        assert_eq!(
            (&node["sha256"], &node["step"]),
            (&json!(want.sha256), &json!(step))
        );
        let from = node["derived_from"].as_array().expect("derived_from");
        if step == "first" {
            assert!(from.is_empty(), "{j:#}");
        } else {
            assert_eq!(from.len(), 1, "{j:#}");
            node = &from[0];
        }
    }

    // get: the exact bytes (49 chunks)
    let file = scratch.path().join("c.bin");
    let file_s = file.to_string_lossy().into_owned();
    let dir_s = store_dir.path().to_string_lossy().into_owned();
    let mut args = vec!["artifact", "get", "--out", &file_s];
    let id = c.id.to_string();
    args.insert(2, &id);
    if backend == ArtifactBackend::Directory {
        // without the shared directory it cannot be read, and says how to fix it
        let out = cli(&t.url, &args);
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("--artifact-dir"),
            "{}",
            text(&out.stderr)
        );
        assert!(!file.exists());
        args.extend(["--artifact-dir", &dir_s]);
    }
    let out = cli(&t.url, &args);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = std::fs::read(&file).expect("written file");
    assert_eq!(got.len(), expect_c.len());
    assert!(got == expect_c, "{backend:?}: the bytes are the artifact's");

    // the same bytes again: the blob is claimed, not stored a second time
    let again = t
        .submit(json!({"name": "again", "steps": [
            {"name": "first", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "a-again.bin", "content": "0123456789abcdef", "repeat": 196608}}]}))
        .await;
    let st = t.wait_terminal(again, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    assert_eq!(tests::step(&st, "first").artifacts[0].sha256, a.sha256);
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.artifact_blobs")
            .await,
        3
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.artifact_chunks")
            .await,
        chunk_rows
    );
    if backend == ArtifactBackend::Directory {
        assert_eq!(files_below(store_dir.path()).len(), 3);
    }
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_round_trips_a_chain_of_multi_chunk_artifacts_with_lineage() {
    let _serial = tests::exclusive().await;
    chain_round_trip(ArtifactBackend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directory_store_round_trips_a_chain_of_multi_chunk_artifacts_with_lineage() {
    let _serial = tests::exclusive().await;
    chain_round_trip(ArtifactBackend::Directory).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_that_lies_fails_with_digest_mismatch_and_stores_nothing() {
    let _serial = tests::exclusive().await;
    for backend in [ArtifactBackend::Postgres, ArtifactBackend::Directory] {
        let t = TestDb::new().await;
        let store_dir = tempfile::tempdir().expect("tempdir");
        let w = RunningWorker::start(t.connect(10).await, config(backend, store_dir.path(), None))
            .await;
        for lie in ["sha256", "size"] {
            // 3 MiB: the sha256 lie is found after every chunk was staged
            let run = t
                .submit(json!({"name": format!("lie-{lie}"), "steps": [
                    {"name": "make", "executor_kind": "go", "kind": "demo.artifact",
                     "input": {"name": "a.bin", "content": "0123456789abcdef",
                               "repeat": 196608, "lie": lie}}]}))
                .await;
            let st = t.wait_terminal(run, Duration::from_secs(60)).await;
            let s = tests::step(&st, "make");
            assert_eq!(s.state, "terminal_failed", "{backend:?} {lie}");
            let e = s.error.as_ref().expect("error");
            assert_eq!(
                e.code, "ARTIFACT_DIGEST_MISMATCH",
                "{backend:?} {lie}: {e:?}"
            );
            let what = if lie == "sha256" {
                "sha256 mismatch"
            } else {
                "manifest says 3145729 bytes, file has 3145728"
            };
            assert!(e.message.contains(what), "{backend:?} {lie}: {}", e.message);
            assert!(s.artifacts.is_empty());
            for table in ["artifacts", "artifact_blobs", "artifact_chunks"] {
                assert_eq!(
                    t.scalar_i64(&format!("SELECT count(*) FROM durable.{table}"))
                        .await,
                    0,
                    "{backend:?} {lie}: durable.{table}"
                );
            }
            assert_eq!(
                files_below(store_dir.path()),
                Vec::<PathBuf>::new(),
                "{backend:?} {lie}"
            );
        }
        w.shutdown().await;
    }
}
