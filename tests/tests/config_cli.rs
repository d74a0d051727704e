//! The worker config through the real `supervisor` binary:
//! `worker --print-default-config` (every field, with its default, parses
//! back), `DURABLE_*` environment overrides, and validation at start that
//! names the key.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::json;
use supervisor::config::{ExecutorConfig, WorkerConfig};
use tests::TestDb;

/// `supervisor executors --config FILE` (warnings logged), its output.
fn executors_with(file: &str) -> Output {
    Command::new(tests::supervisor_bin())
        .args(["executors", "--config", file])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("executors")
}

/// Runs the binary with a clean environment as far as the config goes: no
/// database URL and no `DURABLE_*` variable unless given.
fn cli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = tests::supervisor_clean("error");
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run supervisor")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every field serde knows for a config struct, from its own "unknown field"
/// message ("expected one of `a`, `b`, ..."): what the printed config must cover.
fn serde_fields(unknown: &str) -> BTreeSet<String> {
    let err = toml::from_str::<WorkerConfig>(unknown).expect_err("unknown field");
    let msg = err.to_string();
    let list = msg
        .split("expected one of")
        .nth(1)
        .unwrap_or_else(|| panic!("no field list in {msg}"));
    list.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The printed config with every `#key = value` / `#[[executors]]` line
/// uncommented (documentation comments are `# text`).
fn uncommented(text: &str) -> String {
    text.lines()
        .map(|l| match l.strip_prefix('#') {
            Some(rest)
                if rest.starts_with("[[") || rest.starts_with(|c: char| c.is_ascii_lowercase()) =>
            {
                rest
            }
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn print_default_config_prints_every_field_with_its_default_and_parses_back() {
    let o = cli(&["worker", "--print-default-config"], &[]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = String::from_utf8(o.stdout).expect("UTF-8");

    // as printed: exactly the defaults (the example executor is commented out)
    let cfg: WorkerConfig = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(cfg, WorkerConfig::default());

    // every field of WorkerConfig and ExecutorConfig, each with a comment above
    let worker_fields = serde_fields("zzz_not_a_key = 1");
    let executor_fields = serde_fields("[[executors]]\nzzz_not_a_key = 1");
    assert!(worker_fields.contains("lease_ttl_ms") && worker_fields.contains("executors"));
    assert!(executor_fields.contains("command") && executor_fields.contains("concurrency"));
    let lines: Vec<&str> = text.lines().collect();
    let documented = |key: &str| {
        lines.iter().enumerate().any(|(i, l)| {
            let l = l.strip_prefix('#').unwrap_or(l);
            l.starts_with(&format!("{key} = "))
                && i > 0
                && lines[..i]
                    .iter()
                    .rev()
                    .take_while(|p| p.starts_with("# "))
                    .count()
                    > 0
        })
    };
    for f in worker_fields.iter().filter(|f| *f != "executors") {
        assert!(
            documented(f),
            "worker field {f} is not printed with a comment:\n{text}"
        );
    }
    assert!(text.contains("#[[executors]]"), "{text}");
    for f in &executor_fields {
        assert!(
            documented(f),
            "executor field {f} is not printed with a comment:\n{text}"
        );
    }
    // the defaults are stated in words too
    assert!(text.contains("lease_ttl_ms = 10000"), "{text}");
    assert!(text.contains("# Default: 10000 (10 s)."), "{text}");
    assert!(text.contains("# Default: 8388608 (8 MiB)."), "{text}");

    // uncommented, it is a complete example: every optional setting set
    let full: WorkerConfig = toml::from_str(&uncommented(&text))
        .unwrap_or_else(|e| panic!("uncommented: {e}\n{}", uncommented(&text)));
    assert!(full.database_url.is_some() && full.name.is_some());
    assert!(full.work_dir.is_some() && full.secrets_dir.is_some());
    assert_eq!(full.metrics_addr.as_deref(), Some("127.0.0.1:9464"));
    assert_eq!(full.executors.len(), 1);
    let e = &full.executors[0];
    let d = ExecutorConfig::default();
    assert!(!e.name.is_empty() && !e.command.is_empty());
    assert!(!e.args.is_empty() && !e.env.is_empty() && !e.secrets.is_empty());
    assert!(!e.labels.is_empty() && e.kinds.is_some() && e.max_jobs_per_process.is_some());
    assert_eq!(e.env_allowlist, d.env_allowlist);
    assert_eq!(e.concurrency, d.concurrency);
    // persistent, as the persistent-only keys set beside it need: uncommented
    // as it is, it warns of nothing (audit 90: "max_jobs_per_process has no
    // effect with persistent = false")
    assert!(e.persistent);
    assert_eq!(full.ignored_settings(), Vec::<String>::new());
    // and valid, but for the directories that do not exist here
    let mut full = full;
    full.secrets_dir = None;
    full.work_dir = None;
    full.validate().expect("the uncommented example is valid");

    // it needs no config file, and refuses one next to it
    let o = cli(
        &["worker", "--print-default-config", "--config", "x.toml"],
        &[],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = cli(&["worker"], &[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--config"), "{}", stderr(&o));
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write config");
    p.to_string_lossy().into_owned()
}

const EXEC: &str = "[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n";

/// `worker --config FILE` with no database: a valid config gets as far as
/// the database ("no database", exit 2); an invalid one stops at the config.
fn start(file: &str, env: &[(&str, &str)]) -> Output {
    cli(&["worker", "--config", file], env)
}

fn assert_valid(o: &Output, what: &str) {
    assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(o));
    assert!(
        stderr(o).contains("no database"),
        "{what}: the config was refused: {}",
        stderr(o)
    );
}

fn assert_invalid(o: &Output, fragments: &[&str], what: &str) {
    assert_eq!(o.status.code(), Some(2), "{what}: {}", stderr(o));
    assert!(
        !stderr(o).contains("no database"),
        "{what}: accepted: {}",
        stderr(o)
    );
    // nothing of a start before the refusal (audit 79: the reaper's
    // start-up line came first, as if the worker had started)
    assert!(
        !stderr(o).contains("orphan reaper running"),
        "{what}: {}",
        stderr(o)
    );
    for f in fragments {
        assert!(
            stderr(o).contains(f),
            "{what}: {:?} does not contain {f:?}",
            stderr(o)
        );
    }
}

#[test]
fn validation_at_start_names_the_key_and_checks_ranges() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ok = write(dir.path(), "ok.toml", EXEC);
    assert_valid(&start(&ok, &[]), "the minimal config");

    for (what, text, fragments) in [
        (
            "unknown top-level key",
            format!("lease_ttl = 5000\n{EXEC}"),
            vec!["unknown field `lease_ttl`", "bad.toml"],
        ),
        (
            "unknown executor key",
            format!("{EXEC}concurency = 2\n"),
            vec!["unknown field `concurency`"],
        ),
        (
            "wrong type",
            format!("lease_ttl_ms = \"10s\"\n{EXEC}"),
            vec!["lease_ttl_ms"],
        ),
        (
            "lease too short",
            format!("lease_ttl_ms = 100\n{EXEC}"),
            vec!["lease_ttl_ms = 100", "below 200"],
        ),
        (
            "lease longer than a day",
            format!("lease_ttl_ms = 100000000000\n{EXEC}"),
            vec!["lease_ttl_ms = 100000000000", "one day"],
        ),
        (
            "heartbeat over half the lease",
            format!("heartbeat_interval_ms = 6000\n{EXEC}"),
            vec!["heartbeat_interval_ms = 6000", "half of lease_ttl_ms"],
        ),
        (
            "zero poll interval",
            format!("poll_interval_ms = 0\n{EXEC}"),
            vec!["poll_interval_ms = 0 must be positive"],
        ),
        (
            "zero handshake",
            format!("handshake_timeout_ms = 0\n{EXEC}"),
            vec!["handshake_timeout_ms = 0"],
        ),
        (
            "graces do not fit in the lease",
            format!("cancel_grace_ms = 4000\nterm_grace_ms = 4000\n{EXEC}"),
            vec!["cancel_grace_ms", "term_grace_ms", "lease_ttl_ms"],
        ),
        (
            "tiny frame cap",
            format!("max_frame_bytes = 10\n{EXEC}"),
            vec!["max_frame_bytes = 10"],
        ),
        (
            "huge stderr tail",
            format!("stderr_tail_bytes = 1000000000\n{EXEC}"),
            vec!["stderr_tail_bytes = 1000000000"],
        ),
        (
            "pool smaller than the concurrency",
            format!("db_max_connections = 3\n{EXEC}"),
            vec!["db_max_connections = 3"],
        ),
        (
            "zero refusals",
            format!("max_refusals = 0\n{EXEC}"),
            vec!["max_refusals = 0"],
        ),
        (
            "artifact above the result cap",
            format!("max_artifact_bytes = 2000\nmax_result_bytes = 1000\n{EXEC}"),
            vec!["max_artifact_bytes (2000)", "max_result_bytes (1000)"],
        ),
        (
            "zero concurrency",
            format!("{EXEC}concurrency = 0\n"),
            vec!["executor \"x\"", "concurrency = 0"],
        ),
        (
            "zero jobs per process",
            format!("{EXEC}max_jobs_per_process = 0\n"),
            vec!["executor \"x\"", "max_jobs_per_process = 0"],
        ),
        (
            "warm processes of a one-shot executor",
            format!("{EXEC}warm_processes = 1\n"),
            vec!["executor \"x\"", "warm_processes = 1", "persistent = true"],
        ),
        (
            "more warm processes than can serve",
            format!("{EXEC}persistent = true\nconcurrency = 2\nwarm_processes = 3\n"),
            vec!["executor \"x\"", "warm_processes = 3", "concurrency = 2"],
        ),
        ("no executors", String::new(), vec!["no [[executors]]"]),
        // found by the routing audit: a raw database error at registration
        // (exit 1), or a label name no step can have
        (
            "a NUL in a label",
            format!("{EXEC}labels = {{ z = \"a\\u0000b\" }}\n"),
            vec!["executor \"x\"", "label", "NUL"],
        ),
        (
            "a blank label name",
            format!("{EXEC}labels = {{ \"\" = \"x\" }}\n"),
            vec!["executor \"x\"", "must not be blank"],
        ),
        // found by the durability-and-config audit: exit 1 with messages
        // that named neither the key nor the file, or no check at all
        (
            "an empty name",
            format!("name = \"\"\n{EXEC}"),
            vec!["name = \"\" is blank", "bad.toml"],
        ),
        (
            "a work_dir that does not exist",
            format!("work_dir = \"/nonexistent/durable-work\"\n{EXEC}"),
            vec![
                "work_dir = \"/nonexistent/durable-work\" is not an existing directory",
                "bad.toml",
            ],
        ),
        (
            "an idle timeout beyond a day",
            format!("{EXEC}persistent = true\nidle_timeout_ms = 999999999999\n"),
            vec![
                "executor \"x\"",
                "idle_timeout_ms = 999999999999",
                "one day",
            ],
        ),
    ] {
        let bad = write(dir.path(), "bad.toml", &text);
        assert_invalid(&start(&bad, &[]), &fragments, what);
    }
    // the messages of range checks say where the value came from
    let bad = write(
        dir.path(),
        "bad.toml",
        &format!("lease_ttl_ms = 100\n{EXEC}"),
    );
    assert_invalid(&start(&bad, &[]), &["bad.toml"], "file named");
}

#[test]
fn durable_variables_override_top_level_keys() {
    let dir = tempfile::tempdir().expect("tempdir");
    // invalid as written (the heartbeat is over half the lease) ...
    let file = write(
        dir.path(),
        "w.toml",
        &format!("lease_ttl_ms = 10000\nheartbeat_interval_ms = 6000\n{EXEC}"),
    );
    assert_invalid(
        &start(&file, &[]),
        &["heartbeat_interval_ms = 6000"],
        "as written",
    );
    // ... valid once the environment raises the lease
    assert_valid(
        &start(&file, &[("DURABLE_LEASE_TTL_MS", "20000")]),
        "DURABLE_LEASE_TTL_MS=20000",
    );
    // ... or lowers the heartbeat; an empty variable changes nothing
    assert_valid(
        &start(&file, &[("DURABLE_HEARTBEAT_INTERVAL_MS", "1000")]),
        "DURABLE_HEARTBEAT_INTERVAL_MS",
    );
    assert_invalid(
        &start(&file, &[("DURABLE_HEARTBEAT_INTERVAL_MS", "")]),
        &["heartbeat_interval_ms = 6000"],
        "empty variable",
    );

    // an override that makes a valid file invalid is named in the message
    let ok = write(dir.path(), "ok.toml", EXEC);
    assert_invalid(
        &start(&ok, &[("DURABLE_LEASE_TTL_MS", "5000")]),
        &["lease_ttl_ms (5000)", "DURABLE_LEASE_TTL_MS"],
        "override breaks the graces",
    );
    // values that do not parse name the variable and the value
    for (var, value, fragment) in [
        (
            "DURABLE_LEASE_TTL_MS",
            "abc",
            "\"abc\" is not a whole number",
        ),
        ("DURABLE_LEASE_TTL_MS", "-5", "\"-5\" is not a whole number"),
        ("DURABLE_LEASE_TTL_MS", "10s", "milliseconds"),
        ("DURABLE_MAX_FRAME_BYTES", "8MiB", "bytes"),
        ("DURABLE_EXECUTORS", "x", "[[executors]]"),
    ] {
        let o = start(&ok, &[(var, value)]);
        assert_invalid(&o, &[var, fragment], &format!("{var}={value}"));
    }
    // DURABLE_ variables that are no config key are left alone
    assert_valid(
        &start(
            &ok,
            &[("DURABLE_CHAOS_SEED", "7"), ("DURABLE_NOT_A_KEY", "x")],
        ),
        "other DURABLE_ variables",
    );
}

/// End to end: a worker started with `DURABLE_NAME` and `DURABLE_LEASE_TTL_MS`
/// registers under that name and leases for that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_with_the_overridden_settings() {
    let _x = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    cfg.lease_ttl_ms = 30_000;
    cfg.drain_timeout_ms = 500;
    let file = write(dir.path(), "w.toml", &tests::worker_toml(&cfg));
    let mut child = Command::new(tests::supervisor_bin())
        .args(["worker", "--config", &file])
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "warn")
        .env("DURABLE_NAME", "named-from-env")
        .env("DURABLE_LEASE_TTL_MS", "4000")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("worker.err")).expect("log"))
        .spawn()
        .expect("spawn worker");
    let run = t
        .submit(tests::one_step(
            "long",
            "go",
            "demo.sleep",
            json!({"ms": 20000, "steps": 2}),
        ))
        .await;
    let st = t
        .wait_run(run, Duration::from_secs(30), |s| {
            s.steps.first().is_some_and(|s| s.state == "running")
        })
        .await;
    let id = st.steps[0].step_run_id;
    // the lease lasts 4 s from its last renewal, not the file's 30 s
    let left_ms: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM durable.lease_expiry(id) - now())::float8 * 1000 FROM durable.step_runs WHERE id = $1",
    )
    .bind(id)
    .fetch_one(t.db.pool())
    .await
    .expect("lease expiry");
    assert!(
        left_ms > 0.0 && left_ms <= 4_500.0,
        "the lease has {left_ms} ms left"
    );
    let names: Vec<String> = sqlx::query_scalar("SELECT name FROM durable.workers")
        .fetch_all(t.db.pool())
        .await
        .expect("workers");
    assert_eq!(names, ["named-from-env"]);
    t.db.cancel(run, None).await.expect("cancel");
    t.wait_terminal(run, Duration::from_secs(30)).await;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let status = tokio::task::spawn_blocking(move || child.wait())
        .await
        .expect("join")
        .expect("wait");
    assert_eq!(status.code(), Some(0));
}

/// An executor command that cannot be run is a config error (exit 2, naming
/// the executor and the key) when the file is loaded: before, the worker got
/// as far as the executor's handshake and exited 1 ("did not answer the
/// handshake: failed to spawn").
#[test]
fn an_executor_command_that_cannot_be_run_is_a_config_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let plain = dir.path().join("not-executable.sh");
    std::fs::write(&plain, "#!/bin/sh\n").expect("write");
    for (what, command, fragments) in [
        (
            "missing file",
            "/nonexistent/bin/executor".to_owned(),
            vec!["[[executors]] \"x\"", "cannot be run", "No such file"],
        ),
        (
            "not executable",
            plain.to_string_lossy().into_owned(),
            vec!["[[executors]] \"x\"", "is not executable", "chmod +x"],
        ),
        (
            "a directory",
            dir.path().to_string_lossy().into_owned(),
            vec!["is not a file"],
        ),
        (
            "a name not on PATH",
            "no-such-executor-anywhere".to_owned(),
            vec!["is not found on PATH"],
        ),
    ] {
        let text = format!("[[executors]]\nname = \"x\"\ncommand = {command:?}\n");
        let file = write(dir.path(), "bad.toml", &text);
        let mut fragments = fragments;
        fragments.push("bad.toml");
        assert_invalid(&start(&file, &[]), &fragments, what);
    }
    // a name on PATH is fine
    let file = write(
        dir.path(),
        "ok.toml",
        "[[executors]]\nname = \"x\"\ncommand = \"true\"\n",
    );
    assert_valid(&start(&file, &[]), "a name on PATH");
}

/// A misspelt `DURABLE_*` override is named at start with the setting it most
/// likely meant (it is still ignored: other programs may use the prefix);
/// before, it was ignored without a word while the same typo in the file is
/// refused.
#[test]
fn a_misspelt_environment_override_is_named_with_its_nearest_setting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ok = write(dir.path(), "ok.toml", EXEC);
    let o = start(
        &ok,
        &[
            ("RUST_LOG", "warn"),
            ("DURABLE_LEASE_TLL_MS", "3000"),
            ("DURABLE_LOG_FORMAT", "text"),
        ],
    );
    assert_valid(&o, "a misspelt override does not stop the worker");
    let err = stderr(&o);
    assert!(
        err.contains(
            "DURABLE_LEASE_TLL_MS is not a worker setting and is ignored; did you mean DURABLE_LEASE_TTL_MS?"
        ),
        "{err}"
    );
    assert!(
        !err.contains("DURABLE_LOG_FORMAT is not"),
        "a variable the runtime reads is not named: {err}"
    );
}

/// `supervisor dev` takes the same `DURABLE_<KEY>` overrides as a worker's
/// file: two dev sessions on one host can have process slots (names) of
/// their own. Its printed config shows them; a bad value is named, exit 2.
#[test]
fn dev_takes_the_environments_overrides() {
    let o = cli(
        &["dev", "--print-config"],
        &[("DURABLE_NAME", "dev-2"), ("DURABLE_LEASE_TTL_MS", "30000")],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let cfg: toml::Table = toml::from_str(&String::from_utf8_lossy(&o.stdout)).expect("toml");
    assert_eq!(cfg["name"].as_str(), Some("dev-2"));
    assert_eq!(cfg["lease_ttl_ms"].as_integer(), Some(30000));
    // without them: the defaults, and a name of its own for a plain worker
    let o = cli(&["dev", "--print-config"], &[]);
    let cfg: toml::Table = toml::from_str(&String::from_utf8_lossy(&o.stdout)).expect("toml");
    assert_eq!(cfg["name"].as_str(), Some("demo-worker-1"));
    assert_eq!(cfg["lease_ttl_ms"].as_integer(), Some(10000));
    for (var, value, fragment) in [
        (
            "DURABLE_LEASE_TTL_MS",
            "abc",
            "\"abc\" is not a whole number",
        ),
        ("DURABLE_LEASE_TTL_MS", "100", "lease_ttl_ms"),
    ] {
        let o = cli(&["dev", "--print-config"], &[(var, value)]);
        assert_eq!(o.status.code(), Some(2), "{var}={value}");
        let err = stderr(&o);
        assert!(
            err.contains(var) && err.contains(fragment),
            "{var}={value}: {err}"
        );
    }
}

/// A credential in the database URL is not printed: not a password behind a
/// misspelt parameter name in an error (the log promised an unknown
/// parameter's value never is), not `DURABLE_DATABASE_URL`'s password in
/// `dev --print-config` (DATABASE_URL's never was) (security audit), not the
/// line of a config file a parse error is on (re-check audit).
#[test]
fn no_credential_of_the_database_url_is_printed() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("addr").port()
    };
    let url = format!("postgres://bob:PW_W1@127.0.0.1:{port}/app?pasword=MyRealPassw0rd");
    let o = cli(&["runs"], &[("DATABASE_URL", url.as_str())]);
    let said = format!("{}{}", String::from_utf8_lossy(&o.stdout), stderr(&o));
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains("pasword=***"), "{said}");
    assert!(
        !said.contains("MyRealPassw0rd") && !said.contains("PW_W1"),
        "{said}"
    );

    // a config file's parse error names the line, not what is on it
    let dir = tempfile::tempdir().expect("tempdir");
    for (file, text) in [
        (
            "syntax.toml",
            "name = \"x\"\ndatabase_url = \"postgres://u:Sup3rSecretPW@h/db\" junk\n",
        ),
        (
            "type.toml",
            "name = \"x\"\ndatabase_url = [\"postgres://u:Sup3rSecretPW@h/db\"]\n",
        ),
    ] {
        let path = dir.path().join(file);
        std::fs::write(&path, text).expect("write");
        let o = cli(&["worker", "--config", &path.to_string_lossy()], &[]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{file}: {err}");
        assert!(err.contains("line 2, column"), "{file}: {err}");
        assert!(!err.contains("Sup3rSecretPW"), "{file}: {err}");
    }

    let o = cli(
        &["dev", "--print-config"],
        &[(
            "DURABLE_DATABASE_URL",
            "postgres://postgres:PRINTPW2@127.0.0.1:5432/x",
        )],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(!out.contains("PRINTPW2"), "{out}");
    let cfg: toml::Table = toml::from_str(&out).expect("toml");
    assert!(!cfg.contains_key("database_url"), "{out}");
    assert!(out.contains("database_url is left out"), "{out}");
    // one without a credential is printed as it is
    let o = cli(
        &["dev", "--print-config"],
        &[(
            "DURABLE_DATABASE_URL",
            "postgres://postgres@127.0.0.1:5432/x",
        )],
    );
    let cfg: toml::Table = toml::from_str(&String::from_utf8_lossy(&o.stdout)).expect("toml");
    assert_eq!(
        cfg["database_url"].as_str(),
        Some("postgres://postgres@127.0.0.1:5432/x")
    );
}

/// A stop signal while the worker starts (here: a probe process that never
/// says hello) stops it at once, exit 0, leaving no process behind. It waited
/// out the whole handshake timeout (configurable up to a day), then exited 1.
#[tokio::test]
async fn a_stop_signal_during_start_up_stops_the_worker_at_once() {
    // SIGHUP (a closed terminal) is a stop signal too: it killed the worker
    // on the spot, no drain
    for signal in [
        nix::sys::signal::Signal::SIGTERM,
        nix::sys::signal::Signal::SIGHUP,
    ] {
        stop_during_start_up(signal).await;
    }
}

async fn stop_during_start_up(signal: nix::sys::signal::Signal) {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        dir.path(),
        "deaf.toml",
        "name = \"startup-stop\"\nhandshake_timeout_ms = 60000\n\
         [[executors]]\nname = \"deaf\"\ncommand = \"/bin/sleep\"\nargs = [\"613.25\"]\n",
    );
    let mut child = Command::new(tests::supervisor_bin())
        .args(["worker", "--config", &file])
        .env("DATABASE_URL", &t.url)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn worker");
    // the probe is started and waits for a hello
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !sleeper_alive("613.25") {
        assert!(std::time::Instant::now() < until, "the probe never started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let signalled = std::time::Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).expect("signal");
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if signalled.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("the worker did not stop within 10 s of {signal} during start-up");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut err = String::new();
    use std::io::Read;
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    assert_eq!(status.code(), Some(0), "{signal}: {err}");
    assert!(
        err.contains("stop signal during start-up"),
        "{signal}: {err}"
    );
    assert!(
        signalled.elapsed() < Duration::from_secs(5),
        "{:?}",
        signalled.elapsed()
    );
    assert!(
        !sleeper_alive("613.25"),
        "the probe process outlived the worker"
    );
}

/// `executors` (and `conformance`) stopped by a signal while an executor
/// does not answer: its process is killed and its probe directory removed,
/// exit 128 + the signal; the directory is made in work_dir. They were left
/// behind in /tmp, whatever work_dir said (README walk-through audit).
#[tokio::test]
async fn a_stopped_probe_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work dir");
    let file = write(
        dir.path(),
        "deaf.toml",
        &format!(
            "work_dir = {:?}\nhandshake_timeout_ms = 60000\n\
             [[executors]]\nname = \"deaf\"\ncommand = \"/bin/sleep\"\nargs = [\"614.25\"]\n",
            work.display().to_string()
        ),
    );
    let mut child = Command::new(tests::supervisor_bin())
        .args(["executors", "--config", &file])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn executors");
    let probes = || {
        std::fs::read_dir(&work)
            .expect("read work_dir")
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with("durable-probe-")
            })
            .count()
    };
    // the probe's directory is in work_dir, and its process runs
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while probes() != 1 || !sleeper_alive("614.25") {
        assert!(
            std::time::Instant::now() < until,
            "the probe never started in work_dir"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("SIGTERM");
    let signalled = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break st;
        }
        if signalled.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("executors did not stop within 10 s of SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(143));
    assert_eq!(probes(), 0, "the probe's directory was left behind");
    assert!(
        !sleeper_alive("614.25"),
        "the probe process outlived the command"
    );
}

/// Whether a `sleep ARG` process runs (the probe of the test above).
fn sleeper_alive(arg: &str) -> bool {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .any(|c| c.split(|&b| b == 0).any(|a| a == arg.as_bytes()))
}

/// A `DURABLE_LOG_FORMAT` that is no log format is named, exit 2
/// (observability audit): clap's error named only `--log-format`, which the
/// user had not typed, also when `--log-format` was given.
#[test]
fn a_bad_log_format_in_the_environment_is_named() {
    for args in [
        &["status", "x"][..],
        &["--log-format", "text", "status", "x"][..],
    ] {
        let o = tests::supervisor_clean("warn")
            .args(args)
            .env("DURABLE_LOG_FORMAT", "xml")
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains("DURABLE_LOG_FORMAT=\"xml\" is not a log format"),
            "{args:?}: {err}"
        );
    }
}

/// A persistent executor's setting on a one-shot executor is valid (an
/// example config sets it) but does nothing: the worker says so at start,
/// naming the executor and the setting, where it said nothing before.
#[test]
fn a_persistent_setting_on_a_one_shot_executor_is_named_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let one_shot = write(
        dir.path(),
        "one-shot.toml",
        &format!("{EXEC}max_jobs_per_process = 50\nidle_timeout_ms = 1000\n"),
    );
    let o = start(&one_shot, &[("RUST_LOG", "warn")]);
    assert_valid(&o, "a setting that does nothing does not stop the worker");
    assert!(
        stderr(&o).contains(
            "executor \"x\": max_jobs_per_process = 50 and idle_timeout_ms = 1000 have no effect, as the executor is one-shot (persistent = false"
        ),
        "{}",
        stderr(&o)
    );
    // where it does something, nothing is said
    let persistent = write(
        dir.path(),
        "persistent.toml",
        &format!("{EXEC}persistent = true\nmax_jobs_per_process = 50\nidle_timeout_ms = 1000\n"),
    );
    let o = start(&persistent, &[("RUST_LOG", "warn")]);
    assert_valid(&o, "persistent");
    assert!(!stderr(&o).contains("no effect"), "{}", stderr(&o));
}

/// `executors` checks an executor's `kinds` list as the worker does: one
/// matching none of the kinds offered fails (the worker refuses to start
/// with it; it passed here, exit 0), one naming an unknown kind is warned
/// about, and the kinds a worker would lease are listed.
#[test]
fn executors_checks_the_kinds_list_as_the_worker_does() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = tests::go_demo("go", &[], None).command;
    let run = |kinds: &str| {
        let file = write(
            dir.path(),
            "kinds.toml",
            &format!("[[executors]]\nname = \"go\"\ncommand = {demo:?}\nkinds = {kinds}\n"),
        );
        let o = executors_with(&file);
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr(&o),
        )
    };
    let (code, out, err) = run(r#"["demo.nope"]"#);
    assert_eq!(code, Some(2), "a config error, as for the worker: {err}");
    assert!(err.contains("matches none of the kinds it offers"), "{err}");
    // naming its file, as the worker does (a92)
    assert!(err.contains("kinds.toml)"), "{err}");
    // stdout still says what the executor offers, and that it is refused
    // (routing audit: the line read as a usable executor's)
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json line");
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.contains("matches none of the kinds it offers")),
        "{v}"
    );
    assert!(v["kinds"].as_array().is_some_and(|k| !k.is_empty()), "{v}");
    let (code, out, err) = run(r#"["demo.echo", "demo.typo"]"#);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("demo.typo"),
        "the unknown kind is named: {err}"
    );
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("json line");
    assert_eq!(v["leased_kinds"], serde_json::json!(["demo.echo"]), "{v}");
    assert_eq!(v["persistent"], false);
    assert_eq!(v["error"], serde_json::Value::Null, "{v}");
}

/// `executors` says how many jobs one process serves: the smaller of the
/// hello's and the config's for a persistent executor (`null`: no limit),
/// one for a one-shot one (SDK audit: the effective cap was nowhere to see).
#[test]
fn executors_says_how_many_jobs_a_process_serves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = tests::go_demo("go", &[], None).command;
    for (extra, want) in [
        ("", serde_json::json!(1)),
        ("persistent = true\n", serde_json::Value::Null),
        (
            "persistent = true\nmax_jobs_per_process = 7\n",
            serde_json::json!(7),
        ),
    ] {
        let file = write(
            dir.path(),
            "jobs.toml",
            &format!("[[executors]]\nname = \"go\"\ncommand = {demo:?}\n{extra}"),
        );
        let o = executors_with(&file);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&o.stdout).trim()).expect("json line");
        assert_eq!(v["max_jobs_per_process"], want, "{extra:?}: {v}");
    }
}

/// An executor that does not answer still gets its JSON line, with its
/// error and `null` for what its hello would have said (docs audit: stdout
/// had a line for the working entry only, so a script reading it lost the
/// other entry); exit 1.
#[test]
fn executors_prints_a_line_for_an_executor_that_does_not_answer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = tests::go_demo("go", &[], None).command;
    let file = write(
        dir.path(),
        "silent.toml",
        &format!(
            "handshake_timeout_ms = 1000\n[[executors]]\nname = \"go\"\ncommand = {demo:?}\n\
             [[executors]]\nname = \"silent\"\ncommand = \"sleep\"\nargs = [\"100\"]\n"
        ),
    );
    let o = executors_with(&file);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["executor"], "go");
    assert_eq!(lines[0]["error"], serde_json::Value::Null);
    assert_eq!(lines[1]["executor"], "silent");
    assert!(
        lines[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("no hello within 1000 ms")),
        "{}",
        lines[1]
    );
    assert_eq!(lines[1]["kinds"], serde_json::Value::Null);
    assert_eq!(lines[1]["routes"], 0);
}

/// `executors` warns of a persistent executor's settings on a one-shot one,
/// as the worker does at start (persistent-pool audit: they passed silently).
#[test]
fn executors_warns_of_settings_a_one_shot_executor_ignores() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = tests::go_demo("go", &[], None).command;
    let file = write(
        dir.path(),
        "oneshot.toml",
        &format!(
            "[[executors]]\nname = \"go\"\ncommand = {demo:?}\nmax_jobs_per_process = 3\nidle_timeout_ms = 5\n"
        ),
    );
    let o = executors_with(&file);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "warning: executor \"go\": max_jobs_per_process = 3 and idle_timeout_ms = 5 have no effect"
        ),
        "{}",
        stderr(&o)
    );
}

/// `executors` (and `conformance`) start the executors without a database:
/// a pool too small for a worker's concurrency is no reason to refuse them
/// (SDK audit: a developer checking an executor had to raise
/// `db_max_connections`); the worker still refuses it.
#[test]
fn checking_executors_needs_no_database_pool() {
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = tests::go_demo("go", &[], None).command;
    let entries: String = (1..=3)
        .map(|i| format!("[[executors]]\nname = \"go{i}\"\ncommand = {demo:?}\nconcurrency = 4\n"))
        .collect();
    let file = write(dir.path(), "three.toml", &entries);
    let o = executors_with(&file);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 3);
    assert_invalid(
        &start(&file, &[]),
        &["db_max_connections = 10 is smaller"],
        "a worker still needs the pool",
    );
}

/// An executor whose args name a file by a relative path fails its probe
/// (and `conformance`) with a note that says why (new-user audit: only "can't open file
/// '/tmp/durable-probe-…/pyexec/x.py'", the probe's directory, not the
/// user's, in it).
#[test]
fn a_relative_path_in_args_is_named_when_the_probe_fails() {
    let dir = tempfile::tempdir().expect("tempdir");
    // the script is there, relative to where the worker runs
    std::fs::create_dir(dir.path().join("pyexec")).expect("pyexec");
    std::fs::write(dir.path().join("pyexec/demo_executor.py"), "").expect("script");
    let file = write(
        dir.path(),
        "rel.toml",
        &format!(
            "[[executors]]\nname = \"py\"\ncommand = {:?}\nargs = [\"pyexec/demo_executor.py\", \"application/json\"]\n",
            tests::python().display().to_string()
        ),
    );
    // the worker's probe (`executors`, a worker's start) and `conformance`
    for cmd in ["executors", "conformance"] {
        let out = Command::new(tests::supervisor_bin())
            .current_dir(dir.path())
            .args([cmd, "--config", &file])
            .env_remove("DATABASE_URL")
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .output()
            .expect(cmd);
        assert_ne!(out.status.code(), Some(0), "{cmd}");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            said.contains("a relative path such as \"pyexec/demo_executor.py\"")
                && said.contains("give an absolute path"),
            "{cmd}: {said}"
        );
    }
}

/// An empty `DATABASE_URL` is no database, as for every command: a worker
/// then takes its config's `database_url` (re-check audit: the empty
/// variable hid it, and the error named the very key it ignored).
#[test]
fn an_empty_database_url_leaves_the_configs() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().expect("addr").port()
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        dir.path(),
        "w.toml",
        &format!(
            "database_url = \"postgres://u@127.0.0.1:{port}/cfgdb\"\n[[executors]]\nname = \"x\"\ncommand = \"/bin/true\"\n"
        ),
    );
    let o = cli(&["worker", "--config", &file], &[("DATABASE_URL", "")]);
    let err = stderr(&o);
    assert!(
        err.contains(&format!("127.0.0.1:{port}/cfgdb")) && !err.contains("no database"),
        "{err}"
    );
}

/// The probe's directory in work_dir is the worker's user's alone (0700),
/// as every directory a worker makes there (audit 83: 0755, listable by
/// any user of a shared work_dir). The executor records the mode of the
/// directory it runs in before it fails its handshake.
#[test]
fn the_probes_directory_is_private() {
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work dir");
    let mode_file = dir.path().join("mode");
    let file = write(
        dir.path(),
        "probe.toml",
        &format!(
            "work_dir = {work:?}\n[[executors]]\nname = \"x\"\ncommand = \"/bin/sh\"\nargs = [\"-c\", \"stat -c %a . > {}\"]\n",
            mode_file.display()
        ),
    );
    let o = executors_with(&file);
    assert!(
        !o.status.success(),
        "no hello, a failed probe: {}",
        stderr(&o)
    );
    let mode = std::fs::read_to_string(&mode_file).expect("the executor ran");
    assert_eq!(mode.trim(), "700", "the probe's directory");
}

/// A work_dir every user may write to without the sticky bit is named at
/// start, with what to do (audit 83: another user renamed the worker's
/// fresh directories there and put links to its own in their place, and
/// the worker wrote a job's inputs into them); a sticky one (as /tmp) or
/// a private one is not.
#[test]
fn a_work_dir_any_user_may_rename_in_is_warned_of() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work dir");
    let file = write(
        dir.path(),
        "w.toml",
        &format!("work_dir = {work:?}\n{EXEC}"),
    );
    let start_warn = || {
        tests::supervisor_clean("warn")
            .args(["worker", "--config", &file])
            .output()
            .expect("run supervisor")
    };
    for (mode, warned) in [(0o777, true), (0o1777, false), (0o700, false)] {
        std::fs::set_permissions(&work, std::fs::Permissions::from_mode(mode)).expect("chmod");
        let o = start_warn();
        let err = stderr(&o);
        assert!(err.contains("no database"), "{mode:o}: {err}");
        assert_eq!(
            err.contains("is writable by every user and not sticky (mode 777)")
                && err.contains("chmod +t"),
            warned,
            "{mode:o}: {err}"
        );
    }
}

/// A work_dir on ext4 without a journal is named at start with what to do
/// (there each job directory made and removed slows the next `mkdir`: a
/// third of a busy worker's CPU in a profile of persistent no-op jobs); a
/// tmpfs one is not. Which the host's temp dir is, the kernel says
/// (`supervisor::hostfs`); both cases are run where the host has them.
#[test]
fn a_work_dir_on_ext4_without_a_journal_is_warned_of() {
    let mut bases = vec![std::env::temp_dir()];
    if std::path::Path::new("/dev/shm").is_dir() {
        bases.push("/dev/shm".into());
    }
    for base in bases {
        let dir = tempfile::tempdir_in(&base).expect("tempdir");
        let work = dir.path().join("work");
        std::fs::create_dir(&work).expect("work dir");
        let fs = supervisor::hostfs::Filesystem::of(&work).expect("its filesystem");
        let file = write(
            dir.path(),
            "w.toml",
            &format!("work_dir = {work:?}\n{EXEC}"),
        );
        let o = tests::supervisor_clean("warn")
            .args(["worker", "--config", &file])
            .output()
            .expect("run supervisor");
        let err = stderr(&o);
        assert!(err.contains("no database"), "{}: {err}", base.display());
        let warned =
            err.contains("is on ext4 without a journal") && err.contains("set work_dir to a tmpfs");
        assert_eq!(
            warned,
            fs.slow_to_remake_directories(),
            "{} is {}: {err}",
            base.display(),
            fs.describe()
        );
        if fs.fstype == "tmpfs" {
            assert!(!warned, "{err}");
        }
    }
}

/// A worker's probe runs in a directory of its own that carries the
/// worker's tag (`durable-probe-XXXXXX.<tag>`), as every directory it makes
/// in work_dir: a worker killed during a probe leaves nothing the next
/// one's sweep misses (audit 83: the probe's directory had no tag).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_probe_directory_carries_its_tag() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let work = dir.path().join("work");
    std::fs::create_dir(&work).expect("work dir");
    let record = dir.path().join("cwds");
    let mut e = tests::go_demo("go", &[], None);
    let mut args = vec![
        "-c".to_string(),
        format!("pwd >> {}; exec \"$0\" \"$@\"", record.display()),
        e.command.clone(),
    ];
    args.extend(e.args.clone());
    e.command = "/bin/sh".into();
    e.args = args;
    let mut cfg = tests::fast_config(vec![e]);
    cfg.work_dir = Some(work.clone());
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    w.shutdown().await;
    let cwds = std::fs::read_to_string(&record).expect("the executor ran");
    let probe = cwds.lines().next().expect("the probe's directory");
    let name = Path::new(probe)
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    let (stem, tag) = name.rsplit_once('.').expect("a tag");
    assert!(stem.starts_with("durable-probe-"), "{probe}");
    assert!(
        tag.len() == 12 && tag.bytes().all(|b| b.is_ascii_hexdigit()),
        "{probe}"
    );
    assert_eq!(Path::new(probe).parent(), Some(work.as_path()), "{probe}");
}

/// A worker refused at start for what its config says of an executor (a
/// `kinds` list matching none of the kinds its hello offers) names the
/// config file, as every other config error does (audit 90: "invalid worker
/// setup: …" did not), exit 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refused_for_its_kinds_list_names_the_config_file() {
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let demo = tests::go_demo("go", &[], None).command;
    let file = write(
        dir.path(),
        "kinds.toml",
        &format!("[[executors]]\nname = \"go\"\ncommand = {demo:?}\nkinds = [\"demo.nope\"]\n"),
    );
    let o = tokio::task::spawn_blocking({
        let url = t.url.clone();
        let file = file.clone();
        move || {
            tests::supervisor_clean("kinds")
                .args(["worker", "--config", &file])
                .env("DATABASE_URL", url)
                .output()
                .expect("run supervisor")
        }
    })
    .await
    .expect("join");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("matches none of the kinds it offers")
            && err.contains(&format!("(config {file})")),
        "{err}"
    );
}
