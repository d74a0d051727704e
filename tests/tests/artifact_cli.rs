//! `supervisor artifact get` and `supervisor artifact lineage` through the
//! real binary, on a three-step chain of `demo.artifact` (each step's artifact
//! derived from its input): the whole lineage back to the first input, the
//! exact bytes (sha256 checked, across several read chunks), no overwrite
//! without --force, exit 4 for an unknown artifact.

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tests::{fast_config, go_demo, RunningWorker, TestDb};
use uuid::Uuid;

fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(tests::supervisor_bin())
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_step_chain_shows_its_whole_lineage_and_get_writes_the_exact_bytes() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    // the last artifact is a bit over 2.5 MiB: `get` reads it in three chunks
    let run = t
        .submit(json!({"name": "chain", "steps": [
            {"name": "first", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "a.txt", "content": "0123456789abcdef", "repeat": 65536}},
            {"name": "second", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "b.txt", "content": "B", "repeat": 3}, "depends_on": ["first"]},
            {"name": "third", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "c.txt", "content": "xyz", "repeat": 500000}, "depends_on": ["second"]}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(90)).await;
    assert_eq!(
        st.state,
        "succeeded",
        "{}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    let art = |step: &str| tests::step(&st, step).artifacts[0].clone();
    let (a, b, c) = (art("first"), art("second"), art("third"));
    let mut expect_c = "0123456789abcdef".repeat(65536).into_bytes();
    expect_c.extend_from_slice(b"BBB");
    expect_c.extend_from_slice("xyz".repeat(500_000).as_bytes());
    assert_eq!(c.size, expect_c.len() as i64);

    // lineage --json: c <- b <- a, every node with its step, attempt and run
    let out = cli(
        &t.url,
        &["artifact", "lineage", &c.id.to_string(), "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let j: Value = serde_json::from_slice(&out.stdout).expect("lineage JSON");
    let mut node = &j;
    for (want, step) in [(&c, "third"), (&b, "second"), (&a, "first")] {
        assert_eq!(node["id"], want.id.to_string(), "{j:#}");
        assert_eq!(node["name"], want.name);
        assert_eq!(node["sha256"], want.sha256);
        assert_eq!(node["size"], want.size);
        assert_eq!(node["step"], step);
        assert_eq!(node["attempt"], 1);
        assert_eq!(node["run_id"], run.to_string());
        let from = node["derived_from"].as_array().expect("derived_from");
        if step == "first" {
            assert!(from.is_empty(), "the first input: {j:#}");
        } else {
            assert_eq!(from.len(), 1, "{j:#}");
            node = &from[0];
        }
    }

    // lineage as text: a tree of all three, the first input last
    let out = cli(&t.url, &["artifact", "lineage", &c.id.to_string()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let tree = text(&out.stdout);
    let lines: Vec<&str> = tree.lines().collect();
    assert!(lines[0].starts_with(&format!("c.txt  {}", c.id)), "{tree}");
    assert!(lines[0].contains("step third attempt 1"), "{tree}");
    assert!(
        lines[1].starts_with(&format!("└── b.txt  {}", b.id)),
        "{tree}"
    );
    assert!(
        lines[2].starts_with(&format!("    └── a.txt  {}", a.id))
            && lines[2].contains("step first"),
        "{tree}"
    );
    assert!(
        tree.contains("3 artifacts from 3 steps; first inputs: a.txt"),
        "{tree}"
    );

    // get: the exact bytes
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("c.txt");
    let file_s = file.to_string_lossy().into_owned();
    let out = cli(
        &t.url,
        &["artifact", "get", &c.id.to_string(), "--out", &file_s],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let got = std::fs::read(&file).expect("written file");
    assert_eq!(got.len(), expect_c.len());
    assert_eq!(sha256_hex(&got), c.sha256);
    assert!(got == expect_c, "the bytes are the artifact's");
    assert!(
        text(&out.stderr).contains(&c.sha256),
        "{}",
        text(&out.stderr)
    );

    // an existing file is kept unless --force
    let out = cli(
        &t.url,
        &["artifact", "get", &a.id.to_string(), "--out", &file_s],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("--force"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(sha256_hex(&std::fs::read(&file).expect("file")), c.sha256);
    // the file replaced is someone else's (this runs as root in CI): the
    // new one keeps its owner and group, as its mode
    let root = nix::unistd::geteuid().is_root();
    if root {
        std::os::unix::fs::chown(&file, Some(65534), Some(65534)).expect("chown");
    }
    let out = cli(
        &t.url,
        &[
            "artifact",
            "get",
            &a.id.to_string(),
            "--out",
            &file_s,
            "--force",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(sha256_hex(&std::fs::read(&file).expect("file")), a.sha256);
    if root {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(&file).expect("metadata");
        assert_eq!((m.uid(), m.gid()), (65534, 65534), "the owner is kept");
    }
    // no temporary file is left beside it
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["c.txt".to_string()]);

    // --out - writes to stdout
    let out = cli(
        &t.url,
        &["artifact", "get", &b.id.to_string(), "--out", "-"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert_eq!(sha256_hex(&out.stdout), b.sha256);

    // unknown and malformed ids: exit 4, nothing written
    let missing = dir.path().join("missing");
    let missing_s = missing.to_string_lossy().into_owned();
    for id in [Uuid::new_v4().to_string(), "nope".to_string()] {
        let out = cli(&t.url, &["artifact", "get", &id, "--out", &missing_s]);
        assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("unknown artifact"),
            "{}",
            text(&out.stderr)
        );
        let out = cli(&t.url, &["artifact", "lineage", &id]);
        assert_eq!(out.status.code(), Some(4), "{}", text(&out.stderr));
    }
    assert!(!missing.exists());

    // --out naming a directory: a usage error that says so
    let as_dir = format!("{}/", dir.path().join("nodir").display());
    for target in [dir.path().to_string_lossy().into_owned(), as_dir] {
        let out = cli(
            &t.url,
            &["artifact", "get", &b.id.to_string(), "--out", &target],
        );
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        assert!(
            text(&out.stderr).contains("names a directory"),
            "{target}: {}",
            text(&out.stderr)
        );
    }

    // damaged bytes: the error names the hash read and the one expected,
    // and what was left behind (nothing in a file; stdout's bytes are not
    // the artifact)
    sqlx::query(
        "UPDATE durable.artifact_chunks SET data = 'zz'
          WHERE n = 0 AND upload_id = (SELECT upload_id FROM durable.artifact_blobs WHERE sha256 = $1)",
    )
        .bind(&b.sha256)
        .execute(t.db.pool())
        .await
        .expect("damage b");
    let damaged = dir.path().join("b.txt");
    let damaged_s = damaged.to_string_lossy().into_owned();
    let out = cli(
        &t.url,
        &["artifact", "get", &b.id.to_string(), "--out", &damaged_s],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("but it is") && err.contains(&format!("with sha256 {}", b.sha256)),
        "{err}"
    );
    assert!(err.contains("nothing was written to the file"), "{err}");
    assert!(!damaged.exists());
    let out = cli(
        &t.url,
        &["artifact", "get", &b.id.to_string(), "--out", "-"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("standard output is not the artifact") && !err.contains("nothing was written"),
        "{err}"
    );
    w.shutdown().await;
}

/// `--out` that is not a regular file is written through, never replaced:
/// a FIFO stays a FIFO and its reader gets the bytes, `/dev/null` stays the
/// device (no --force needed: nothing is overwritten). A symlink to a file
/// keeps being a symlink and its file gets the bytes; a dangling one is
/// refused. Before, `--force` renamed a plain file over any of them (as
/// root, over /dev/null itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_writes_through_what_is_not_a_regular_file() {
    use std::os::unix::fs::FileTypeExt;
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let run = t
        .submit(json!({"name": "one", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.artifact", "input": {"name": "a.txt", "content": "abc", "repeat": 1000}}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    let a = tests::step(&st, "s").artifacts[0].clone();
    let id = a.id.to_string();
    w.shutdown().await;
    let dir = tempfile::tempdir().expect("tempdir");

    let fifo = dir.path().join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    let reader = {
        let fifo = fifo.clone();
        std::thread::spawn(move || std::fs::read(fifo).expect("read the fifo"))
    };
    let fifo_s = fifo.to_string_lossy().into_owned();
    let out = cli(
        &t.url,
        &["artifact", "get", &id, "--out", &fifo_s, "--force"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // (checked first: were it replaced, its reader would wait forever)
    assert!(std::fs::symlink_metadata(&fifo)
        .expect("fifo")
        .file_type()
        .is_fifo());
    assert_eq!(sha256_hex(&reader.join().expect("reader")), a.sha256);

    let out = cli(&t.url, &["artifact", "get", &id, "--out", "/dev/null"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(std::fs::symlink_metadata("/dev/null")
        .expect("/dev/null")
        .file_type()
        .is_char_device());

    let file = dir.path().join("file.txt");
    std::fs::write(&file, "old").expect("file");
    let link = dir.path().join("link.txt");
    std::os::unix::fs::symlink(&file, &link).expect("symlink");
    let link_s = link.to_string_lossy().into_owned();
    let out = cli(&t.url, &["artifact", "get", &id, "--out", &link_s]);
    assert_eq!(out.status.code(), Some(2), "an existing file needs --force");
    let out = cli(
        &t.url,
        &["artifact", "get", &id, "--out", &link_s, "--force"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(std::fs::symlink_metadata(&link)
        .expect("link")
        .file_type()
        .is_symlink());
    assert_eq!(sha256_hex(&std::fs::read(&file).expect("file")), a.sha256);

    let dangling = dir.path().join("dangling");
    std::os::unix::fs::symlink(dir.path().join("nowhere/x"), &dangling).expect("symlink");
    let out = cli(
        &t.url,
        &[
            "artifact",
            "get",
            &id,
            "--out",
            &dangling.to_string_lossy(),
            "--force",
        ],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("does not exist"),
        "{}",
        text(&out.stderr)
    );
}

/// A file `artifact get` writes gets the mode any file the user creates
/// gets (0666 less the umask), and one it replaces with `--force` keeps its
/// own: it was 0644 whatever the umask, and `--force` widened a 0600 file
/// (security audit).
#[tokio::test]
async fn get_writes_a_file_with_the_users_mode() {
    use std::os::unix::fs::PermissionsExt;
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let run = t
        .submit(
            json!({"name": "one", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.artifact", "input": {"name": "a.txt", "content": "abc", "repeat": 10}}]}),
        )
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    let id = tests::step(&st, "s").artifacts[0].id.to_string();
    w.shutdown().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let get = |umask: &str, out: &std::path::Path, force: bool| {
        let script = format!(
            "umask {umask} && exec \"$0\" artifact get {id} --out \"$1\"{}",
            if force { " --force" } else { "" }
        );
        let o = Command::new("/bin/sh")
            .args(["-c", &script])
            .arg(tests::supervisor_bin())
            .arg(out)
            .env("DATABASE_URL", &t.url)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .output()
            .expect("sh");
        assert_eq!(o.status.code(), Some(0), "{}", text(&o.stderr));
    };
    let mode =
        |p: &std::path::Path| std::fs::metadata(p).expect("written").permissions().mode() & 0o777;
    let private = dir.path().join("private.txt");
    get("077", &private, false);
    assert_eq!(mode(&private), 0o600);
    let shared = dir.path().join("shared.txt");
    get("002", &shared, false);
    assert_eq!(mode(&shared), 0o664);
    // replaced: its own mode stays, whatever the umask
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o640)).expect("chmod");
    get("022", &private, true);
    assert_eq!(mode(&private), 0o640);
    // its permission bits only: not setuid (re-check audit)
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o4755)).expect("chmod");
    get("022", &private, true);
    let all = std::fs::metadata(&private)
        .expect("written")
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(all, 0o755);
}

/// `artifact lineage` lists an artifact's inputs in the order they were
/// given (the order of its bytes), not by when they were made: here `right`
/// is made before `left`, and the join, which depends on [left, right], is
/// L then R. Before, the lineage listed `right` first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lineage_lists_the_inputs_in_their_order() {
    let t = TestDb::new().await;
    let w = RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let run = t
        .submit(json!({"name": "join", "steps": [
            {"name": "right", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "right.txt", "content": "R"}},
            {"name": "slow", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 300, "steps": 1}},
            {"name": "left", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "left.txt", "content": "L"}, "depends_on": ["slow"]},
            {"name": "both", "executor_kind": "go", "kind": "demo.artifact",
             "input": {"name": "both.txt", "content": "!"}, "depends_on": ["left", "right"]}]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    assert_eq!(st.state, "succeeded");
    w.shutdown().await;
    let both = tests::step(&st, "both").artifacts[0].clone();
    let out = cli(
        &t.url,
        &["artifact", "get", &both.id.to_string(), "--out", "-"],
    );
    assert_eq!(
        text(&out.stdout),
        "LR!",
        "the bytes are left's, then right's"
    );
    let out = cli(
        &t.url,
        &["artifact", "lineage", &both.id.to_string(), "--json"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let j: Value = serde_json::from_slice(&out.stdout).expect("lineage JSON");
    let names: Vec<&str> = j["derived_from"]
        .as_array()
        .expect("derived_from")
        .iter()
        .filter_map(|n| n["name"].as_str())
        .collect();
    assert_eq!(names, ["left.txt", "right.txt"], "{j:#}");
}
