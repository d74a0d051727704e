//! `supervisor watch RUN_ID` through the real binary: plain lines and the
//! exit codes of a succeeded, a failed and a cancelled run through pipes, an
//! unknown run, and the live bars in a real pseudo-terminal (the screen
//! replayed by a small terminal model and checked).

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::Stdio;
use std::time::Duration;

use serde_json::json;
use tests::{fast_config, go_demo, RunningWorker, TestDb};
use uuid::Uuid;

async fn worker(t: &TestDb) -> RunningWorker {
    RunningWorker::start(
        t.connect(10).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await
}

/// `supervisor watch RUN` through pipes; (exit code, stdout, stderr).
async fn watch_piped(url: &str, run: &str) -> (Option<i32>, String, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(tests::supervisor_bin())
            .args(["watch", run, "--interval-ms", "100"])
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .output(),
    )
    .await
    .expect("watch ended within 90 s")
    .expect("run supervisor watch");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_lines_and_the_exit_code_of_a_succeeded_run() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = worker(&t).await;
    let run = t
        .submit(json!({"name": "watched", "steps": [
            {"name": "nap", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 1500, "steps": 5}},
            {"name": "after", "executor_kind": "go", "kind": "demo.echo",
             "input": {"x": 1}, "depends_on": ["nap"]}]}))
        .await;
    let (code, out, err) = watch_piped(&t.url, &run.to_string()).await;
    assert_eq!(code, Some(0), "stdout: {out}\nstderr: {err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        !out.contains('\x1b'),
        "no escape sequences through a pipe: {out:?}"
    );
    assert!(
        lines.contains(&"after: waiting on nap"),
        "the waiting step is named with what it waits on: {out}"
    );
    // progress arrives as lines with the fraction and the executor's message
    let progress: Vec<&&str> = lines
        .iter()
        .filter(|l| {
            l.starts_with("nap: running, attempt 1, ") && l.contains("%, ") && l.contains("slept ")
        })
        .collect();
    assert!(!progress.is_empty(), "progress lines: {out}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("nap: succeeded, attempt 1, 100%")),
        "{out}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("after: succeeded, attempt 1")),
        "{out}"
    );
    let last = lines.last().copied().unwrap_or_default();
    assert!(
        last.starts_with(&format!("run {run} watched: succeeded in ")),
        "the final state is the last line: {out}"
    );
    // one line per change: no line is printed twice in a row
    for pair in lines.windows(2) {
        assert_ne!(pair[0], pair[1], "a repeated line: {out}");
    }
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_run_exits_1_and_names_the_error() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = worker(&t).await;
    let run = t
        .submit(json!({"name": "doomed", "steps": [
            {"name": "boom", "executor_kind": "go", "kind": "demo.fail",
             "input": {"code": "NOPE", "retryable": false, "message": "no way"}}]}))
        .await;
    let (code, out, err) = watch_piped(&t.url, &run.to_string()).await;
    assert_eq!(code, Some(1), "stdout: {out}\nstderr: {err}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("boom: terminal_failed, attempt 1") && l.ends_with("NOPE")),
        "{out}"
    );
    assert!(out.contains("boom: NOPE: no way\n"), "{out}");
    assert!(out.contains(": failed in "), "{out}");
    w.shutdown().await;
}

/// The README's "one line per change of a step" holds between two reads:
/// attempts that fail and retry within one interval are printed from the
/// history (artifacts audit: three failed attempts showed as
/// "running, attempt 1" then "succeeded, attempt 4").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_lines_include_the_attempts_between_two_reads() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "flaky", "steps": [
            {"name": "f", "executor_kind": "go", "kind": "demo.fail",
             "retry": {"max_attempts": 5, "initial_interval_ms": 50, "backoff_coefficient": 1.0},
             "input": {"fail_attempts": 3}}]}))
        .await;
    // the watch's first read sees the step pending; the worker starts after
    // it, and the next read is a few seconds later
    let watch = tokio::process::Command::new(tests::supervisor_bin())
        .args([
            "watch",
            &run.to_string(),
            "--plain",
            "--interval-ms",
            "4000",
        ])
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("watch");
    tokio::time::sleep(Duration::from_millis(800)).await;
    let w = worker(&t).await;
    let out = tokio::time::timeout(Duration::from_secs(60), watch.wait_with_output())
        .await
        .expect("watch ended")
        .expect("watch output");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    let failed: Vec<&&str> = lines
        .iter()
        .filter(|l| l.starts_with("f: retryable_failed, attempt "))
        .collect();
    assert_eq!(failed.len(), 3, "each failed attempt has its line: {text}");
    for (i, l) in failed.iter().enumerate() {
        assert!(
            l.starts_with(&format!("f: retryable_failed, attempt {}, ", i + 1)),
            "in order, with the failure: {text}"
        );
    }
    let at = |p: &str| lines.iter().position(|l| l.starts_with(p));
    assert!(
        at("f: pending") < at("f: retryable_failed, attempt 1")
            && at("f: retryable_failed, attempt 3") < at("f: succeeded, attempt 4"),
        "{text}"
    );
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_exits_3() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = worker(&t).await;
    let run = t
        .submit(json!({"name": "stopped", "steps": [
            {"name": "long", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 60000, "steps": 60}}]}))
        .await;
    let watcher = tokio::spawn({
        let url = t.url.clone();
        async move { watch_piped(&url, &run.to_string()).await }
    });
    t.wait_run(run, Duration::from_secs(30), |s| {
        s.steps.first().is_some_and(|s| s.state == "running")
    })
    .await;
    // long enough for the watcher (a process starting up, polling every
    // 100 ms) to have seen the step running
    tokio::time::sleep(Duration::from_millis(1500)).await;
    t.db.cancel(run, None).await.expect("cancel");
    let (code, out, err) = watcher.await.expect("watcher");
    assert_eq!(code, Some(3), "stdout: {out}\nstderr: {err}");
    assert!(out.contains("long: running, attempt 1"), "{out}");
    assert!(out.contains("long: cancelled, attempt 1"), "{out}");
    assert!(out.contains(": cancelled in "), "{out}");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_run_exits_4() {
    let t = TestDb::new().await;
    let (code, out, err) = watch_piped(&t.url, &Uuid::new_v4().to_string()).await;
    assert_eq!(code, Some(4), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("unknown run"), "{err}");
    assert!(out.is_empty(), "{out}");
    let (code, _, err) = watch_piped(&t.url, "not-a-uuid").await;
    assert_eq!(code, Some(4), "{err}");
}

/// A watch that cannot follow the run is not the run's failure: exit 5, not
/// 1 (which a script reads as "the run failed"), with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_that_cannot_reach_the_database_exits_5_not_1() {
    // a port nothing listens on
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let (code, out, err) = watch_piped(&url, &Uuid::new_v4().to_string()).await;
    assert_eq!(code, Some(5), "stdout: {out}\nstderr: {err}");
    assert!(err.contains("cannot reach the database"), "{err}");
    assert!(err.contains("watch RUN_ID"), "{err}");
}

// ---------------------------------------------------------------------------
// a real pseudo-terminal

/// A pseudo-terminal pair of `cols` × `rows`: (master, slave).
fn openpty(cols: u16, rows: u16) -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: openpty writes two fds into our ints and reads our winsize
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &ws,
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both fds are fresh and ours alone
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}

/// Runs `cmd` with stdin, stdout and stderr on a new pseudo-terminal of
/// `cols` columns (and a UTF-8 locale, colours allowed) until it exits;
/// (exit code, everything it wrote).
async fn in_pty(mut cmd: std::process::Command, cols: u16) -> (Option<i32>, String) {
    let (master, slave) = openpty(cols, 30);
    let mut child = cmd
        .env("RUST_LOG", "info")
        .env("TERM", "xterm-256color")
        .env("LANG", "C.UTF-8")
        .env_remove("LC_ALL")
        .env_remove("NO_COLOR")
        .stdin(Stdio::from(slave.try_clone().expect("dup slave")))
        .stdout(Stdio::from(slave.try_clone().expect("dup slave")))
        .stderr(Stdio::from(slave))
        .spawn()
        .expect("spawn supervisor on a pty");
    // the parent's copies of the slave go with `cmd`: the child holds the last
    drop(cmd);
    // read the master until the child (the last holder of the slave) exits
    let reader = std::thread::spawn(move || {
        let mut f = std::fs::File::from(master);
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => all.extend_from_slice(&buf[..n]),
                // EIO: the slave side is closed
                Err(_) => break,
            }
        }
        all
    });
    let until = std::time::Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("the command on the pty did not end within 90 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let raw = String::from_utf8_lossy(&reader.join().expect("reader")).into_owned();
    (status.code(), raw)
}

/// A terminal just good enough for what `watch` writes: printable text, CR,
/// LF, cursor up (CSI n A), erase line (CSI 2K), erase below (CSI J); other
/// CSI sequences (colours, cursor visibility) take no room.
struct Screen {
    lines: Vec<Vec<char>>,
    row: usize,
    col: usize,
    cols: usize,
    /// How many times the cursor moved up: the frames drawn over the last.
    redraws: usize,
}

impl Screen {
    fn new(cols: usize) -> Screen {
        Screen {
            lines: vec![Vec::new()],
            row: 0,
            col: 0,
            cols,
            redraws: 0,
        }
    }

    fn feed(&mut self, text: &str) {
        let mut it = text.chars().peekable();
        while let Some(c) = it.next() {
            match c {
                '\r' => self.col = 0,
                '\n' => {
                    // the pty turns LF into CR LF (onlcr)
                    self.row += 1;
                    self.col = 0;
                    if self.row == self.lines.len() {
                        self.lines.push(Vec::new());
                    }
                }
                '\x1b' if it.peek() == Some(&'[') => {
                    it.next();
                    let mut params = String::new();
                    let mut fin = ' ';
                    for c in it.by_ref() {
                        if c.is_ascii_alphabetic() {
                            fin = c;
                            break;
                        }
                        params.push(c);
                    }
                    match fin {
                        'A' => {
                            let n: usize = params.parse().unwrap_or(1);
                            self.row = self.row.saturating_sub(n);
                            self.redraws += 1;
                        }
                        'K' => self.lines[self.row].clear(),
                        'J' => self.lines.truncate(self.row + 1),
                        _ => {}
                    }
                }
                c => {
                    assert!(self.col < self.cols, "a line wrapped: {:?}", self.text());
                    let line = &mut self.lines[self.row];
                    if line.len() <= self.col {
                        line.resize(self.col, ' ');
                        line.push(c);
                    } else {
                        line[self.col] = c;
                    }
                    self.col += 1;
                }
            }
        }
    }

    fn text(&self) -> String {
        self.lines
            .iter()
            .map(|l| l.iter().collect::<String>().trim_end().to_owned())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_bars_in_a_pseudo_terminal() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let w = worker(&t).await;
    let run = t
        .submit(json!({"name": "on-screen", "steps": [
            {"name": "nap", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 2000, "steps": 8}},
            {"name": "after", "executor_kind": "go", "kind": "demo.echo",
             "input": {"x": 1}, "depends_on": ["nap"]}]}))
        .await;

    let cols = 100;
    let mut cmd = std::process::Command::new(tests::supervisor_bin());
    cmd.args(["watch", &run.to_string(), "--interval-ms", "100"])
        .env("DATABASE_URL", &t.url);
    let (code, raw) = in_pty(cmd, cols).await;
    assert_eq!(code, Some(0), "screen output: {raw:?}");

    // live mode: the cursor hidden while drawing and shown again at the end,
    // colours, and frames drawn over the last
    assert!(raw.contains("\x1b[?25l"), "{raw:?}");
    assert!(raw.trim_end().ends_with("\x1b[?25h"), "{raw:?}");
    assert!(
        raw.contains("\x1b[36mrunning"),
        "running in colour: {raw:?}"
    );
    let mut screen = Screen::new(usize::from(cols));
    screen.feed(&raw);
    assert!(screen.redraws >= 3, "redrawn in place: {raw:?}");
    // a partly filled bar with a percentage was on screen at some point
    assert!(
        raw.contains("█░") && raw.contains("slept "),
        "a partial bar: {raw:?}"
    );

    // the final screen: the header, one line per step, the summary; the
    // frames were drawn in place, so each step appears exactly once
    let text = screen.text();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 4, "header, 2 steps, summary:\n{text}");
    assert!(
        lines[0].starts_with(&format!("run {run}  on-screen  succeeded")),
        "{text}"
    );
    let full = "█".repeat(25);
    assert!(
        lines[1].starts_with("  nap    [")
            && lines[1].contains(&full)
            && lines[1].contains("100%  succeeded")
            && lines[1].contains("attempt 1"),
        "{text}"
    );
    assert!(
        lines[2].starts_with("  after  [") && lines[2].contains("succeeded"),
        "{text}"
    );
    assert!(
        lines[3].starts_with(&format!("run {run} on-screen: succeeded in ")),
        "{text}"
    );
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_submit_on_a_terminal_shows_the_watch_view_and_logs_to_a_file() {
    let _serial = tests::exclusive().await;
    tests::go_executor(); // dev runs the bundled build of it
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        json!({"name": "dev-view", "steps": [
            {"name": "nap", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 1200, "steps": 4}}]})
        .to_string(),
    )
    .expect("write spec");
    let mut cmd = std::process::Command::new(tests::supervisor_bin());
    cmd.arg("dev")
        .arg("--submit")
        .arg(&spec)
        .arg("--exit-when-idle")
        .env("DATABASE_URL", &t.url)
        .current_dir(dir.path());
    let (code, raw) = in_pty(cmd, 100).await;
    assert_eq!(code, Some(0), "screen output: {raw:?}");
    let mut screen = Screen::new(100);
    screen.feed(&raw);
    let text = screen.text();
    assert!(raw.contains("\x1b[?25l"), "the live view: {raw:?}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("  nap  [") && l.contains("100%  succeeded")),
        "{text}"
    );
    assert!(text.contains("dev-view: succeeded in "), "{text}");
    assert!(
        !raw.contains("INFO"),
        "no log lines between the bars: {raw:?}"
    );
    let log = std::fs::read_to_string(dir.path().join(".dev/dev.log")).expect("dev.log");
    assert!(
        log.contains(" INFO "),
        "the worker's log went to the file: {log}"
    );
}

/// A watch stopped by SIGTERM or SIGHUP (a `timeout`, a closed terminal)
/// closes its view as Ctrl-C does, and exits 128 + the signal: the cursor
/// was left hidden. And `dev --exit-when-idle` on a terminal, stopping with a
/// step it cannot run, closes the view before it names that step: the
/// cursor was left hidden and the "left open" line was drawn over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_view_shows_the_cursor_again_and_keeps_what_follows() {
    let _serial = tests::exclusive().await;
    tests::go_executor(); // dev runs the bundled build of it
    let t = TestDb::new().await;
    let pending = t
        .submit(tests::one_step("waits", "nobody", "k", json!({})))
        .await;
    let shown_again = |raw: &str| {
        raw.rfind("\x1b[?25l")
            .is_some_and(|hid| raw[hid..].contains("\x1b[?25h"))
    };
    for (sig, code) in [("TERM", 143), ("HUP", 129)] {
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c")
            .arg(format!(
                "\"$0\" watch {pending} & p=$!; sleep 1.5; kill -{sig} $p; wait $p"
            ))
            .arg(tests::supervisor_bin())
            .env("DATABASE_URL", &t.url);
        let (exit, raw) = in_pty(cmd, 100).await;
        assert_eq!(exit, Some(code), "SIG{sig}: {raw:?}");
        assert!(
            shown_again(&raw),
            "SIG{sig}: the cursor stays hidden: {raw:?}"
        );
    }

    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        json!({"name": "gpu-only", "steps": [
            {"name": "train", "executor_kind": "go", "kind": "demo.echo", "labels": {"gpu": "a100"}}]})
        .to_string(),
    )
    .expect("write spec");
    let mut cmd = std::process::Command::new(tests::supervisor_bin());
    cmd.arg("dev")
        .arg("--submit")
        .arg(&spec)
        .arg("--exit-when-idle")
        .env("DATABASE_URL", &t.url)
        .current_dir(dir.path());
    let (exit, raw) = in_pty(cmd, 250).await;
    assert_eq!(exit, Some(0), "{raw:?}");
    assert!(shown_again(&raw), "the cursor stays hidden: {raw:?}");
    let mut screen = Screen::new(250);
    screen.feed(&raw);
    let text = screen.text();
    assert!(
        text.lines()
            .any(|l| l.starts_with("left open: run ") && l.contains("step \"train\"")),
        "the open step is named below the view: {text}"
    );
}

/// `dev --exit-when-idle` stops once nothing it can run is left, even when
/// the database holds an open run that only another executor could run (the
/// cluster under ./.dev/ is kept between runs): it names that run's step
/// instead of waiting for it for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_exit_when_idle_does_not_wait_for_steps_it_cannot_run() {
    let _serial = tests::exclusive().await;
    tests::go_executor(); // dev runs the bundled build of it
    let t = TestDb::new().await;
    let stuck = t
        .submit(json!({"name": "elsewhere", "steps": [
            {"name": "gpu", "executor_kind": "go", "kind": "demo.echo", "labels": {"gpu": "a100"}}]}))
        .await;
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        tests::one_step("mine", "go", "demo.echo", json!({"a": 1})).to_string(),
    )
    .expect("write spec");
    let child = tokio::process::Command::new(tests::supervisor_bin())
        .arg("dev")
        .arg("--submit")
        .arg(&spec)
        .arg("--exit-when-idle")
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "warn")
        .current_dir(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn dev");
    let out = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("dev did not stop although nothing it can run is left")
        .expect("wait dev");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains(&format!("left open: run {stuck} step \"gpu\"")),
        "the step it cannot run is named: {stderr}"
    );
    let runs: Vec<(String, String)> =
        sqlx::query_as("SELECT name, state FROM durable.workflow_runs ORDER BY name")
            .fetch_all(t.db.pool())
            .await
            .expect("runs");
    assert_eq!(
        runs,
        [
            ("elsewhere".to_owned(), "pending".to_owned()),
            ("mine".to_owned(), "succeeded".to_owned())
        ]
    );
}

/// `dev --submit` of a spec the validator refuses exits 2 leaving no worker
/// registered: it started its worker first and left its row unstopped, so
/// `status` took it for a live worker for 30 s (operator audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_with_a_refused_spec_leaves_no_live_worker_behind() {
    let _serial = tests::exclusive().await;
    tests::go_executor();
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("spec.json");
    std::fs::write(
        &spec,
        json!({"name": "bad", "steps": [{"name": "a", "kind": "demo.echo"}]}).to_string(),
    )
    .expect("write spec");
    let out = std::process::Command::new(tests::supervisor_bin())
        .arg("dev")
        .arg("--submit")
        .arg(&spec)
        .arg("--exit-when-idle")
        .env("DATABASE_URL", &t.url)
        .current_dir(dir.path())
        .stdin(std::process::Stdio::null())
        .output()
        .expect("dev");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("steps[0].executor_kind: is required"), "{err}");
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workers WHERE stopped_at IS NULL")
            .await,
        0,
        "no worker looks live"
    );
}

/// `watch --plain` of a step that no live worker offers says so (once),
/// as `status` does: it printed `pending` and then nothing for ever
/// (operator's tools audit). A worker offering it later runs it, and the
/// watch ends with the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_no_live_worker_offers_is_said_to_wait_for_one() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "orphan", "steps": [
            {"name": "o", "executor_kind": "go", "kind": "demo.echo"}]}))
        .await;
    let watch = tokio::process::Command::new(tests::supervisor_bin())
        .args(["watch", &run.to_string(), "--plain", "--interval-ms", "100"])
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("watch");
    // no worker yet: the first read finds the step stuck
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let w = worker(&t).await;
    let out = tokio::time::timeout(Duration::from_secs(60), watch.wait_with_output())
        .await
        .expect("watch ended")
        .expect("watch output");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    let said = r#"o: waits: no live worker offers executor_kind "go", kind "demo.echo""#;
    assert_eq!(text.matches(said).count(), 1, "{text}");
    assert!(
        text.find(said) < text.find("o: succeeded"),
        "then it ran: {text}"
    );
    w.shutdown().await;
}

/// A watch whose output cannot be written (a full disk) says so and exits
/// 5, as any watch that could not follow the run: it exited 0 with every
/// line lost (re-check audit).
#[tokio::test]
async fn a_watch_that_cannot_write_exits_5_naming_stdout() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "full", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.echo"}]}))
        .await;
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    // std's output() keeps the stdout given (tokio's pipes it whatever)
    let out = std::process::Command::new(tests::supervisor_bin())
        .args(["watch", &run.to_string(), "--plain", "--interval-ms", "100"])
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(full)
        .output()
        .expect("watch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(5), "{stderr}");
    assert!(
        stderr.contains("cannot write to standard output: No space left on device"),
        "{stderr}"
    );
}

/// A database that stops answering mid-watch (a server that hangs, or a
/// network cut: here a lock that stalls every read) ends the watch once
/// its patience runs out, with a timeout: each read is bounded (audit 92:
/// with no bound the watch waited as long as the server did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_stops_answering_ends_the_watch_after_its_patience() {
    let t = TestDb::new().await;
    let run = t
        .submit(tests::one_step("w", "go", "demo.echo", json!({})))
        .await;
    let opts = supervisor::watch::WatchOptions {
        live: false,
        color: false,
        unicode: false,
        interval: Duration::from_millis(50),
        patience: Duration::from_secs(1),
        read_bound: Duration::from_millis(300),
    };
    let db = t.connect(4).await;
    let watching = tokio::spawn(async move {
        let mut out = Vec::new();
        let end =
            supervisor::watch::watch(&db, run, &mut out, &opts, std::future::pending::<i32>())
                .await;
        (end, String::from_utf8_lossy(&out).into_owned())
    });
    // the first read went well: the run is drawn
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.workflow_runs IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *holder)
        .await
        .expect("lock");
    let ended = tokio::time::timeout(Duration::from_secs(10), watching).await;
    holder.rollback().await.expect("rollback");
    let (end, out) = ended
        .expect("the watch waited as long as the stalled reads")
        .expect("join");
    assert!(out.contains("s: pending"), "{out}");
    let e = end.expect_err("the watch gave up");
    assert!(e.is_transient(), "{e}");
    assert!(e.to_string().contains("reading the run"), "{e}");
}
