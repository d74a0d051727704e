//! The operator's read commands through the real `supervisor` binary:
//! `events`, `status` (table and JSON with the latest progress), `runs`, and
//! the exit codes and messages of every kind of failure (README "Exit codes").

use std::collections::BTreeSet;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tests::TestDb;
use uuid::Uuid;

/// Runs the binary against `url` (or with no database URL at all).
fn cli(url: Option<&str>, args: &[&str]) -> Output {
    let mut c = Command::new(tests::supervisor_bin());
    c.args(args)
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null());
    if let Some(u) = url {
        c.env("DATABASE_URL", u);
    }
    c.output().expect("run supervisor")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts the exit code, and that stderr contains every fragment.
fn expect_exit(o: &Output, code: i32, fragments: &[&str], what: &str) {
    assert_eq!(
        o.status.code(),
        Some(code),
        "{what}: exit code; stdout: {}; stderr: {}",
        stdout(o),
        stderr(o)
    );
    for f in fragments {
        assert!(
            stderr(o).contains(f),
            "{what}: stderr {:?} does not contain {f:?}",
            stderr(o)
        );
    }
}

fn json_of(o: &Output, what: &str) -> Value {
    assert_eq!(
        o.status.code(),
        Some(0),
        "{what}: exit code; stderr: {}",
        stderr(o)
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {}", stdout(o)))
}

/// A run with steps `a` and `b` (created, pending) and `c` (waiting on `a`).
async fn three_step_run(t: &TestDb) -> (Uuid, Uuid, Uuid) {
    let run = t
        .submit(json!({"name": "inspect", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k"},
            {"name": "c", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}
        ]}))
        .await;
    let st = t.status(run).await;
    (
        run,
        tests::step(&st, "a").step_run_id,
        tests::step(&st, "b").step_run_id,
    )
}

/// (step, attempt, sequence, kind, message, fraction, checkpoint)
type EventRow = (
    Uuid,
    i32,
    i64,
    &'static str,
    &'static str,
    Option<f64>,
    bool,
);

/// Inserts events as the persistence layer would, in a scrambled order.
async fn insert_events(t: &TestDb, a: Uuid, b: Uuid) {
    insert_event_rows(
        t,
        vec![
            (b, 1, 2, "heartbeat", "", None, false),
            (a, 2, 1, "accepted", "", None, false),
            (a, 1, 3, "progress", "half\nway", Some(0.5), false),
            (b, 1, 1, "progress", "b nearly done", Some(0.9), false),
            (a, 1, 1, "accepted", "", None, false),
            (a, 2, 2, "progress", "again, a quarter", Some(0.25), true),
            (a, 1, 2, "running", "", None, false),
        ],
    )
    .await;
}

/// The line of step `name` in `status`'s table.
fn step_line(text: &str, name: &str) -> String {
    text.lines()
        .find(|l| l.starts_with(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no line for {name} in {text}"))
        .to_owned()
}

/// Inserts these event rows, in this order.
async fn insert_event_rows(t: &TestDb, rows: Vec<EventRow>) {
    for (id, attempt, seq, kind, msg, frac, cp) in rows {
        sqlx::query(
            "INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message, fraction, checkpoint)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(id)
        .bind(attempt)
        .bind(seq)
        .bind(kind)
        .bind(msg)
        .bind(frac)
        .bind(cp)
        .execute(t.db.pool())
        .await
        .expect("insert event");
    }
}

#[tokio::test]
async fn events_are_listed_in_order_per_step_attempt_and_sequence() {
    let t = TestDb::new().await;
    let (run, a, b) = three_step_run(&t).await;
    let run_s = run.to_string();
    // before any event: an empty array, and a sentence instead of a table
    let v = json_of(&cli(Some(&t.url), &["events", &run_s, "--json"]), "events");
    assert_eq!(v, json!([]));
    let o = cli(Some(&t.url), &["events", &run_s]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("no progress events yet"),
        "{}",
        stdout(&o)
    );

    insert_events(&t, a, b).await;
    let v = json_of(&cli(Some(&t.url), &["events", &run_s, "--json"]), "events");
    let keys = |v: &Value| -> Vec<(String, i64, i64)> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|e| {
                (
                    e["step"].as_str().expect("step").to_owned(),
                    e["attempt"].as_i64().expect("attempt"),
                    e["sequence"].as_i64().expect("sequence"),
                )
            })
            .collect()
    };
    let kinds: Vec<String> = v
        .as_array()
        .expect("array")
        .iter()
        .map(|e| e["kind"].as_str().expect("kind").to_owned())
        .collect();
    let got: Vec<(String, i64, i64, String)> = keys(&v)
        .into_iter()
        .zip(kinds)
        .map(|((s, a, q), k)| (s, a, q, k))
        .collect();
    let want: Vec<(String, i64, i64, String)> = [
        ("a", 1, 1, "accepted"),
        ("a", 1, 2, "running"),
        ("a", 1, 3, "progress"),
        ("a", 2, 1, "accepted"),
        ("a", 2, 2, "progress"),
        ("b", 1, 1, "progress"),
        ("b", 1, 2, "heartbeat"),
    ]
    .iter()
    .map(|(s, a, q, k)| (s.to_string(), *a, *q, k.to_string()))
    .collect();
    assert_eq!(got, want);
    let e = &v[4];
    assert_eq!(e["step_run_id"], a.to_string());
    assert_eq!(e["fraction"], 0.25);
    assert_eq!(e["message"], "again, a quarter");
    assert_eq!(e["checkpoint"], true);
    assert!(e["at"].is_string() && e.get("executor_at").is_some(), "{e}");
    assert_eq!(v[0]["fraction"], Value::Null);

    // the last N, in the same order (a step checkpointing without pause
    // stores hundreds of thousands: the whole list took 326 MB to print)
    let v = json_of(
        &cli(Some(&t.url), &["events", &run_s, "--last", "3", "--json"]),
        "events --last 3",
    );
    assert_eq!(
        keys(&v),
        [("a", 2, 2), ("b", 1, 1), ("b", 1, 2)]
            .map(|(s, a, q)| (s.to_string(), a, q))
            .to_vec()
    );
    let v = json_of(
        &cli(
            Some(&t.url),
            &["events", &run_s, "--step", "a", "--last", "2", "--json"],
        ),
        "events --step a --last 2",
    );
    assert_eq!(
        keys(&v),
        [("a", 2, 1), ("a", 2, 2)]
            .map(|(s, a, q)| (s.to_string(), a, q))
            .to_vec()
    );
    let o = cli(Some(&t.url), &["events", &run_s, "--last", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));

    // one step only
    let v = json_of(
        &cli(Some(&t.url), &["events", &run_s, "--step", "b", "--json"]),
        "events --step b",
    );
    let steps: BTreeSet<&str> = v
        .as_array()
        .expect("array")
        .iter()
        .map(|e| e["step"].as_str().expect("step"))
        .collect();
    assert_eq!(steps, BTreeSet::from(["b"]));
    assert_eq!(v.as_array().map(Vec::len), Some(2));

    // the table: a header, one line per event, messages kept on one line
    let o = cli(Some(&t.url), &["events", &run_s]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 8, "{text}");
    for h in [
        "STEP", "ATTEMPT", "SEQ", "TIME", "KIND", "FRACTION", "MESSAGE",
    ] {
        assert!(lines[0].contains(h), "header {:?} lacks {h}", lines[0]);
    }
    assert!(
        lines[3].starts_with("a ") && lines[3].contains("50%") && lines[3].contains("half way"),
        "{text}"
    );
    assert!(
        lines[5].contains("25%") && lines[5].contains("yes") && lines[5].contains("again"),
        "{text}"
    );

    // a step that exists but waits has no events yet; an unknown one is exit 4
    let o = cli(Some(&t.url), &["events", &run_s, "--step", "c", "--json"]);
    assert_eq!(json_of(&o, "events --step c"), json!([]));
    let o = cli(Some(&t.url), &["events", &run_s, "--step", "nope"]);
    expect_exit(
        &o,
        4,
        &["has no step named \"nope\"", "a, b, c"],
        "unknown step",
    );
    let other = Uuid::new_v4().to_string();
    let o = cli(Some(&t.url), &["events", &other]);
    expect_exit(
        &o,
        4,
        &[&format!("unknown run {other}"), "supervisor runs"],
        "unknown run",
    );
}

#[tokio::test]
async fn status_shows_each_steps_latest_progress_and_its_json_only_adds_fields() {
    let t = TestDb::new().await;
    let (run, a, b) = three_step_run(&t).await;
    insert_events(&t, a, b).await;
    let run_s = run.to_string();

    let cli_json = json_of(&cli(Some(&t.url), &["status", &run_s, "--json"]), "status");
    // backward compatible: everything the library's RunStatus says, unchanged
    let lib = serde_json::to_value(t.status(run).await).expect("status as JSON");
    let keys = |v: &Value| -> BTreeSet<String> {
        v.as_object()
            .expect("object")
            .keys()
            .cloned()
            .collect::<BTreeSet<_>>()
    };
    // ... and the steps counted by state, as `runs` counts them
    let mut want = keys(&lib);
    want.insert("step_counts".into());
    assert_eq!(keys(&cli_json), want);
    assert_eq!(
        cli_json["step_counts"],
        json!({"pending": 2, "waiting": 1}),
        "{cli_json}"
    );
    // an open run's finished_at is there, null, as `runs --json` shows it
    // (it was left out until the run ended)
    assert!(cli_json["finished_at"].is_null(), "{cli_json}");
    assert!(keys(&cli_json).contains("finished_at"), "{cli_json}");
    for k in keys(&lib) {
        if k != "steps" {
            assert_eq!(cli_json[&k], lib[&k], "run field {k}");
        }
    }
    let (cli_steps, lib_steps) = (
        cli_json["steps"].as_array().expect("steps"),
        lib["steps"].as_array().expect("steps"),
    );
    assert_eq!(cli_steps.len(), lib_steps.len());
    for (c, l) in cli_steps.iter().zip(lib_steps) {
        for k in keys(l) {
            assert_eq!(c[&k], l[&k], "step {} field {k}", l["name"]);
        }
        // what only the CLI adds: the latest progress, and what a step no
        // live worker offers needs (no worker runs here)
        let extra: Vec<String> = keys(c).difference(&keys(l)).cloned().collect();
        assert!(
            extra
                .iter()
                .all(|k| k == "progress" || k == "no_live_worker_offers"),
            "unexpected fields {extra:?}"
        );
    }
    // the latest progress: the newest attempt's last progress event
    let step = |name: &str| {
        cli_steps
            .iter()
            .find(|s| s["name"] == name)
            .unwrap_or_else(|| panic!("no step {name}"))
            .clone()
    };
    let p = step("a")["progress"].clone();
    assert_eq!(p["attempt"], 2, "{p}");
    assert_eq!(p["sequence"], 2, "{p}");
    assert_eq!(p["fraction"], 0.25, "{p}");
    assert_eq!(p["message"], "again, a quarter", "{p}");
    assert!(p["at"].is_string(), "{p}");
    // a heartbeat is not progress
    assert_eq!(step("b")["progress"]["fraction"], 0.9);
    assert_eq!(step("b")["progress"]["message"], "b nearly done");

    // the table: one line per step, waiting steps included
    let o = cli(Some(&t.url), &["status", &run_s]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.starts_with(&format!("run {run}  inspect  pending")),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "steps 3: 2 pending, 1 waiting"),
        "{text}"
    );
    let header = text
        .lines()
        .find(|l| l.starts_with("STEP"))
        .unwrap_or_else(|| panic!("no header in {text}"));
    for h in ["STATE", "ATTEMPT", "PROGRESS", "ERROR"] {
        assert!(header.contains(h), "{header}");
    }
    let line = |name: &str| step_line(&text, name);
    assert!(
        line("a").contains("pending") && line("a").contains("25% again, a quarter"),
        "{text}"
    );
    assert!(line("b").contains("90% b nearly done"), "{text}");
    assert!(
        line("c").contains("waiting") && line("c").contains("on a"),
        "{text}"
    );
}

/// `status` marks progress that an earlier attempt reported: a retry that
/// has not reported yet showed its predecessor's progress as its own
/// (contract audit).
#[tokio::test]
async fn status_marks_progress_of_an_earlier_attempt() {
    let t = TestDb::new().await;
    let (run, a, b) = three_step_run(&t).await;
    insert_event_rows(
        &t,
        vec![
            (a, 1, 1, "progress", "first try, half", Some(0.5), false),
            (b, 1, 1, "progress", "b on its way", Some(0.4), false),
        ],
    )
    .await;
    // a is on its second attempt, b still on its first
    for (id, attempt) in [(a, 2), (b, 1)] {
        sqlx::query("UPDATE durable.step_runs SET attempt = $2 WHERE id = $1")
            .bind(id)
            .bind(attempt)
            .execute(t.db.pool())
            .await
            .expect("attempt");
    }
    let o = cli(Some(&t.url), &["status", &run.to_string()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    let line = |name: &str| step_line(&text, name);
    assert!(
        line("a").contains("50% first try, half (attempt 1)"),
        "{text}"
    );
    assert!(
        line("b").contains("40% b on its way") && !line("b").contains("(attempt"),
        "{text}"
    );
}

/// A real worker runs a run with progress, a retry and a terminal failure:
/// `events` and `status` show what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_and_status_of_a_real_run() {
    let _x = tests::exclusive().await;
    let t = TestDb::new().await;
    let cfg = tests::fast_config(vec![tests::go_demo("go", &[], None)]);
    let w = tests::RunningWorker::start(t.connect(10).await, cfg).await;
    let run = t
        .submit(json!({"name": "real", "steps": [
            {"name": "sleepy", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 300, "steps": 3}},
            {"name": "flaky", "executor_kind": "go", "kind": "demo.fail",
             "input": {"code": "UPSTREAM_503", "retryable": true, "fail_attempts": 1},
             "retry": {"max_attempts": 3, "initial_interval_ms": 100}},
            {"name": "broken", "executor_kind": "go", "kind": "demo.fail",
             "input": {"code": "BROKEN_INPUT", "retryable": false},
             "depends_on": ["sleepy", "flaky"]}
        ]}))
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    assert_eq!(st.state, "failed");
    let run_s = run.to_string();

    let v = json_of(&cli(Some(&t.url), &["events", &run_s, "--json"]), "events");
    let events = v.as_array().expect("array");
    // per (step, attempt): sequences strictly increase, the terminal is last
    let mut last: Option<(String, i64, i64)> = None;
    for e in events {
        let key = (
            e["step"].as_str().expect("step").to_owned(),
            e["attempt"].as_i64().expect("attempt"),
            e["sequence"].as_i64().expect("sequence"),
        );
        if let Some((s, a, q)) = &last {
            if *s == key.0 && *a == key.1 {
                assert!(key.2 > *q, "out of order: {last:?} then {key:?}");
            }
        }
        last = Some(key);
    }
    let sleepy: Vec<&Value> = events.iter().filter(|e| e["step"] == "sleepy").collect();
    let fractions: Vec<f64> = sleepy
        .iter()
        .filter(|e| e["kind"] == "progress")
        .filter_map(|e| e["fraction"].as_f64())
        .collect();
    assert!(fractions.len() >= 2, "{sleepy:?}");
    assert!(fractions.windows(2).all(|w| w[0] <= w[1]), "{fractions:?}");
    assert_eq!(
        sleepy.last().map(|e| e["kind"].clone()),
        Some(json!("succeeded"))
    );
    // an executor's error ends its attempt as `CODE: message`, as the
    // supervisor's endings do (the code was missing from events)
    let first_end = events
        .iter()
        .rfind(|e| e["step"] == "flaky" && e["attempt"] == 1)
        .expect("flaky's first attempt");
    assert_eq!(first_end["kind"], "retryable_failed", "{first_end}");
    assert!(
        first_end["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("UPSTREAM_503: ")),
        "{first_end}"
    );
    let flaky_attempts: BTreeSet<i64> = events
        .iter()
        .filter(|e| e["step"] == "flaky")
        .filter_map(|e| e["attempt"].as_i64())
        .collect();
    assert_eq!(flaky_attempts, BTreeSet::from([1, 2]));

    let v = json_of(&cli(Some(&t.url), &["status", &run_s, "--json"]), "status");
    let sleepy = v["steps"]
        .as_array()
        .expect("steps")
        .iter()
        .find(|s| s["name"] == "sleepy")
        .expect("sleepy")
        .clone();
    assert_eq!(sleepy["progress"]["fraction"], 1.0, "{sleepy}");

    let o = cli(Some(&t.url), &["status", &run_s]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    let line = |name: &str| step_line(&text, name);
    let cols =
        |name: &str| -> Vec<String> { line(name).split_whitespace().map(str::to_owned).collect() };
    assert_eq!(cols("sleepy")[1..4], ["succeeded", "1", "100%"], "{text}");
    assert_eq!(cols("flaky")[1..3], ["succeeded", "2"], "{text}");
    assert_eq!(cols("broken")[1..3], ["terminal_failed", "1"], "{text}");
    assert_eq!(
        cols("broken").last().map(String::as_str),
        Some("BROKEN_INPUT"),
        "{text}"
    );
    // the error's message is printed in full below the table
    assert!(text.contains("broken: BROKEN_INPUT: "), "{text}");
}

#[tokio::test]
async fn runs_are_listed_newest_first_and_filtered() {
    let t = TestDb::new().await;
    let old = t
        .submit(json!({"name": "beta", "steps": [
            {"name": "x", "executor_kind": "go", "kind": "k"},
            {"name": "y", "executor_kind": "go", "kind": "k", "depends_on": ["x"]}]}))
        .await;
    // two hours old (a pending run may change anything but its state)
    sqlx::query(
        "UPDATE durable.workflow_runs SET created_at = now() - interval '2 hours' WHERE id = $1",
    )
    .bind(old)
    .execute(t.db.pool())
    .await
    .expect("backdate");
    let a1 = t
        .submit(tests::one_step("alpha", "go", "k", json!({})))
        .await;
    let a2 = t
        .submit(tests::one_step("alpha", "go", "k", json!({})))
        .await;
    t.db.cancel(a1, None).await.expect("cancel");

    let ids = |v: &Value| -> Vec<String> {
        v.as_array()
            .expect("array")
            .iter()
            .map(|r| r["run_id"].as_str().expect("run_id").to_owned())
            .collect()
    };
    let v = json_of(&cli(Some(&t.url), &["runs", "--json"]), "runs");
    assert_eq!(
        ids(&v),
        [a2.to_string(), a1.to_string(), old.to_string()],
        "{v:#}"
    );
    let beta = &v[2];
    assert_eq!(beta["name"], "beta");
    assert_eq!(beta["state"], "pending");
    assert_eq!(beta["steps"], json!({"pending": 1, "waiting": 1}));
    // the name `status --json` gives the same counts
    assert_eq!(beta["step_counts"], json!({"pending": 1, "waiting": 1}));
    assert!(beta["created_at"].is_string() && beta["finished_at"].is_null());
    assert_eq!(v[1]["state"], "cancelled");
    assert_eq!(v[1]["steps"], json!({"cancelled": 1}));
    assert_eq!(v[1]["step_counts"], v[1]["steps"]);
    assert!(v[1]["finished_at"].is_string());

    for (args, want) in [
        (vec!["--state", "cancelled"], vec![a1]),
        (vec!["--state", "pending"], vec![a2, old]),
        (vec!["--name", "alpha"], vec![a2, a1]),
        (vec!["--name", "alpha", "--state", "pending"], vec![a2]),
        (vec!["--since", "1h"], vec![a2, a1]),
        (vec!["--since", "3h"], vec![a2, a1, old]),
        (vec!["--since", "1h30m", "--name", "beta"], vec![]),
        (vec!["--limit", "1"], vec![a2]),
        (vec!["--name", "nothing-like-it"], vec![]),
    ] {
        let mut all = vec!["runs", "--json"];
        all.extend(&args);
        let v = json_of(&cli(Some(&t.url), &all), &format!("{all:?}"));
        let want: Vec<String> = want.iter().map(Uuid::to_string).collect();
        assert_eq!(ids(&v), want, "{args:?}");
    }

    // pages: a page that is not the last says how to get the next (on
    // stderr: stdout stays the JSON array), `--before` gets it, with the
    // filters kept (operator audit: 50 of 50,000 runs read as all, and no
    // run past the 100,000 cap could be listed)
    let page = |args: &[&str]| {
        let mut all = vec!["runs", "--json"];
        all.extend(args);
        let o = cli(Some(&t.url), &all);
        let v = json_of(&o, &format!("{all:?}"));
        (ids(&v), stderr(&o))
    };
    let a2s = a2.to_string();
    let a1s = a1.to_string();
    let (got, note) = page(&["--limit", "1"]);
    assert_eq!(got, vec![a2s.clone()]);
    assert!(
        note.contains(&format!(
            "(more runs match: the next 1 with `--before {a2}`)"
        )),
        "{note}"
    );
    let (got, note) = page(&["--limit", "2", "--before", &a2s]);
    assert_eq!(got, vec![a1s.clone(), old.to_string()]);
    assert!(!note.contains("more runs match"), "the last page: {note}");
    let (got, note) = page(&["--name", "alpha", "--limit", "1", "--before", &a2s]);
    assert_eq!(got, vec![a1s.clone()]);
    assert!(!note.contains("more runs match"), "{note}");
    let (got, _) = page(&["--before", &old.to_string()]);
    assert!(got.is_empty(), "{got:?}");
    let (_, note) = page(&[]);
    assert!(!note.contains("more runs match"), "one page: {note}");
    let unknown = Uuid::new_v4().to_string();
    let o = cli(Some(&t.url), &["runs", "--before", &unknown]);
    expect_exit(&o, 4, &[&unknown], "an unknown --before");

    // the table
    let o = cli(Some(&t.url), &["runs"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    for h in ["RUN", "NAME", "STATE", "CREATED", "FINISHED", "STEPS"] {
        assert!(lines[0].contains(h), "{text}");
    }
    assert!(
        lines[1].starts_with(&a2.to_string()) && lines[1].contains("1 pending"),
        "{text}"
    );
    assert!(
        lines[3].contains("beta") && lines[3].contains("1 pending, 1 waiting"),
        "{text}"
    );
    let o = cli(Some(&t.url), &["runs", "--name", "nothing-like-it"]);
    assert!(stdout(&o).contains("no runs match"), "{}", stdout(&o));

    // bad input is exit 2, naming the value
    for (args, fragment) in [
        (vec!["runs", "--since", "10x"], "\"10x\" is not a duration"),
        (vec!["runs", "--since", "5"], "\"5\" is not a duration"),
        (vec!["runs", "--state", "done"], "'done'"),
        (vec!["runs", "--limit", "0"], "'0'"),
    ] {
        let o = cli(Some(&t.url), &args);
        expect_exit(&o, 2, &[fragment], &format!("{args:?}"));
    }
}

#[tokio::test]
async fn runs_lists_fifty_by_default() {
    let t = TestDb::new().await;
    for i in 0..55 {
        t.submit(tests::one_step(&format!("r{i}"), "go", "k", json!({})))
            .await;
    }
    let v = json_of(&cli(Some(&t.url), &["runs", "--json"]), "runs");
    assert_eq!(v.as_array().map(Vec::len), Some(50));
    let v = json_of(
        &cli(Some(&t.url), &["runs", "--json", "--limit", "100"]),
        "runs",
    );
    assert_eq!(v.as_array().map(Vec::len), Some(55));
    assert_eq!(v[0]["name"], "r54");
}

/// `events` of a run or step that ended without any does not say "yet"
/// (audit: a step cancelled before it ran had "no progress events yet").
#[tokio::test]
async fn events_of_what_ended_without_any_say_why_none_will_come() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "never", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}))
        .await
        .to_string();
    // open: nothing yet
    let o = cli(Some(&t.url), &["events", &run]);
    assert_eq!(stdout(&o), "no progress events yet\n", "{}", stderr(&o));
    let o = cli(Some(&t.url), &["events", &run, "--step", "b"]);
    assert_eq!(stdout(&o), "no progress events yet\n", "{}", stderr(&o));
    let o = cli(Some(&t.url), &["cancel", &run]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = cli(Some(&t.url), &["events", &run]);
    assert_eq!(
        stdout(&o),
        "no progress events: the run is cancelled (no step ran)\n",
        "{}",
        stderr(&o)
    );
    for step in ["a", "b"] {
        let o = cli(Some(&t.url), &["events", &run, "--step", step]);
        assert_eq!(
            stdout(&o),
            format!("no progress events: step {step} is cancelled (it never ran)\n"),
            "{}",
            stderr(&o)
        );
    }
}

/// A TCP port on 127.0.0.1 where nothing listens.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    drop(l);
    port
}

#[tokio::test]
async fn every_failure_has_its_exit_code_and_a_message_naming_the_fix() {
    let t = TestDb::new().await;
    let unknown = Uuid::new_v4().to_string();

    // 4: unknown run or step
    for args in [
        vec!["status", unknown.as_str()],
        vec!["status", unknown.as_str(), "--json"],
        vec!["events", unknown.as_str()],
        vec!["cancel", unknown.as_str()],
    ] {
        let o = cli(Some(&t.url), &args);
        expect_exit(&o, 4, &[unknown.as_str()], &format!("{args:?}"));
    }
    let run = t
        .submit(tests::one_step("x", "go", "k", json!({})))
        .await
        .to_string();
    let o = cli(Some(&t.url), &["cancel", &run, "--step", "nope"]);
    expect_exit(
        &o,
        4,
        &["no step named \"nope\""],
        "cancel of an unknown step",
    );
    let o = cli(Some(&t.url), &["events", "not-a-uuid"]);
    expect_exit(
        &o,
        4,
        &["\"not-a-uuid\" is not a run id", "supervisor runs"],
        "bad run id",
    );

    // 2: malformed spec, naming the problem
    let spec = tempfile::NamedTempFile::new().expect("tmp");
    std::fs::write(spec.path(), "{\"name\": ").expect("write");
    let path = spec.path().to_str().expect("path");
    let o = cli(Some(&t.url), &["submit", path]);
    expect_exit(&o, 2, &["not JSON"], "spec not JSON");
    std::fs::write(spec.path(), json!({"name": "x", "steps": []}).to_string()).expect("write");
    let o = cli(Some(&t.url), &["submit", path]);
    expect_exit(
        &o,
        2,
        &["steps: must contain at least one step"],
        "empty steps",
    );
    let o = cli(Some(&t.url), &["submit", "/nonexistent/spec.json"]);
    expect_exit(
        &o,
        2,
        &[
            "cannot read /nonexistent/spec.json",
            "give the path of a workflow spec (a JSON file), or - to read it from stdin",
        ],
        "missing file: what it is and what to do",
    );
    let dir = tempfile::tempdir().expect("tmp");
    let o = cli(
        Some(&t.url),
        &["submit", dir.path().to_str().expect("path")],
    );
    expect_exit(&o, 2, &["not a directory"], "a directory");
    let through_a_file = spec.path().join("x");
    let o = cli(
        Some(&t.url),
        &["submit", through_a_file.to_str().expect("path")],
    );
    expect_exit(
        &o,
        2,
        &["is a file, not a directory"],
        "a path through a file",
    );

    // 2: usage
    let o = cli(Some(&t.url), &["runs", "--bogus"]);
    expect_exit(&o, 2, &["--bogus"], "unknown flag");
    let o = cli(Some(&t.url), &["events"]);
    expect_exit(&o, 2, &["RUN_ID"], "missing argument");
    // a URL from DATABASE_URL is not a flag the user gave: the usage line
    // does not tell them to pass one (it said `--database-url <DATABASE_URL>`)
    assert!(
        stderr(&o).contains("Usage: supervisor events <RUN_ID>")
            && !stderr(&o).contains("--database-url"),
        "usage with DATABASE_URL set: {}",
        stderr(&o)
    );
    let o = cli(Some(&t.url), &["runs", "--json"]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "DATABASE_URL is read: {}",
        stderr(&o)
    );
    // an empty flag is none, as an empty variable is: the variable's URL
    let o = cli(Some(&t.url), &["--database-url", "", "runs", "--json"]);
    assert_eq!(o.status.code(), Some(0), "empty flag: {}", stderr(&o));
    // a DATABASE_URL that is not UTF-8 is refused, naming why, by the
    // commands that connect; the others never read it (re-check audit:
    // `worker --print-default-config` exited 2 on it)
    {
        use std::os::unix::ffi::OsStrExt;
        let bad = std::ffi::OsStr::from_bytes(b"postgres://\xff@127.0.0.1/db");
        let run = |args: &[&str]| {
            Command::new(tests::supervisor_bin())
                .args(args)
                .env("DATABASE_URL", bad)
                .env("RUST_LOG", "error")
                .stdin(Stdio::null())
                .output()
                .expect("run supervisor")
        };
        let o = run(&["worker", "--print-default-config"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let o = run(&["runs"]);
        expect_exit(
            &o,
            2,
            &["not valid UTF-8"],
            "a DATABASE_URL that is not UTF-8",
        );
    }

    // 2: no database configured, or a URL that is not one
    let o = cli(None, &["runs"]);
    expect_exit(&o, 2, &["no database", "DATABASE_URL"], "no DATABASE_URL");
    let o = cli(Some("not a url"), &["runs"]);
    expect_exit(
        &o,
        2,
        &["not a valid PostgreSQL URL", "DATABASE_URL", "postgres://"],
        "malformed URL",
    );

    // 1: the database cannot be reached: said at once, naming DATABASE_URL
    let url = format!("postgres://nobody:secret-pw@127.0.0.1:{}/db", closed_port());
    for args in [
        vec!["runs"],
        vec!["status", unknown.as_str()],
        vec!["events", unknown.as_str()],
        vec!["cancel", unknown.as_str()],
        vec!["migrate"],
    ] {
        let started = Instant::now();
        let o = cli(Some(&url), &args);
        expect_exit(
            &o,
            1,
            &["cannot reach the database", "Check DATABASE_URL"],
            &format!("unreachable: {args:?}"),
        );
        assert!(
            !stderr(&o).contains("secret-pw"),
            "the password is printed: {}",
            stderr(&o)
        );
        if args != ["migrate"] {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{args:?} took {:?} to report an unreachable database",
                started.elapsed()
            );
        }
    }
    // nor in a query parameter, nor in a key=value DSN (a bad URL here)
    for (url, code, says) in [
        (
            format!(
                "postgres://nobody@127.0.0.1:{}/db?password=secret-pw",
                closed_port()
            ),
            1,
            "cannot reach the database",
        ),
        (
            "host=127.0.0.1 port=1 user=bob password=secret-pw dbname=x".to_string(),
            2,
            "not a valid PostgreSQL URL",
        ),
    ] {
        let o = cli(Some(&url), &["runs"]);
        expect_exit(&o, code, &[says, "[REDACTED]"], &url);
        assert!(
            !stderr(&o).contains("secret-pw"),
            "the password is printed: {}",
            stderr(&o)
        );
    }
    let spec_ok = tempfile::NamedTempFile::new().expect("tmp");
    std::fs::write(
        spec_ok.path(),
        tests::one_step("x", "go", "k", json!({})).to_string(),
    )
    .expect("write");
    let o = cli(
        Some(&url),
        &["submit", spec_ok.path().to_str().expect("path")],
    );
    expect_exit(
        &o,
        1,
        &["cannot reach the database", "DATABASE_URL"],
        "submit, unreachable",
    );

    // 1: a database that does not exist, and one that was never migrated
    let missing = tests::db_url(&t.url, &format!("t_missing_{}", Uuid::new_v4().simple()));
    let o = cli(Some(&missing), &["runs"]);
    expect_exit(
        &o,
        1,
        &["no such database", "DATABASE_URL"],
        "no such database",
    );
    let bare = format!("t_{}", Uuid::new_v4().simple());
    sqlx::query(&format!("CREATE DATABASE {bare}"))
        .execute(t.db.pool())
        .await
        .expect("create database");
    let bare_url = tests::db_url(&t.url, &bare);
    for args in [vec!["runs"], vec!["status", unknown.as_str()]] {
        let o = cli(Some(&bare_url), &args);
        expect_exit(
            &o,
            1,
            &["no durable schema", "supervisor migrate"],
            &format!("unmigrated: {args:?}"),
        );
    }
}

/// A live worker "w" that offers executor_kind "go", kind "demo.echo" with
/// `labels`: its id.
async fn live_go_worker(t: &TestDb, labels: Value) -> uuid::Uuid {
    let w = uuid::Uuid::new_v4();
    t.db.register_worker(
        w,
        "w",
        "test",
        &json!([{"executor": "go", "routes": [
            {"executor_kind": "go", "kind": "demo.echo", "labels": labels}]}]),
    )
    .await
    .expect("register");
    w
}

/// `status` says why a step waits when no live worker offers what it needs
/// (its executor_kind, kind and labels), and says nothing of a step a live
/// worker could lease: before, such a step showed `pending 0` and nothing
/// else, for ever.
#[tokio::test]
async fn status_names_the_steps_no_live_worker_offers() {
    let t = TestDb::new().await;
    let w = live_go_worker(&t, json!({"zone": "a"})).await;
    let run = t
        .submit(json!({"name": "routes", "steps": [
            {"name": "ok", "executor_kind": "go", "kind": "demo.echo"},
            {"name": "zoned", "executor_kind": "go", "kind": "demo.echo", "labels": {"zone": "a"}},
            {"name": "gpu", "executor_kind": "go", "kind": "demo.echo", "labels": {"gpu": "a100"}},
            {"name": "rust", "executor_kind": "rust", "kind": "x"}]}))
        .await
        .to_string();
    let o = cli(Some(&t.url), &["status", &run]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains(
            "gpu: no live worker offers executor_kind \"go\", kind \"demo.echo\", labels {\"gpu\":\"a100\"}: it waits for one"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "rust: no live worker offers executor_kind \"rust\", kind \"x\": it waits for one"
        ),
        "{out}"
    );
    assert!(
        !out.contains("ok: no live worker") && !out.contains("zoned: no live worker"),
        "a step a live worker offers: {out}"
    );
    // a worker that stopped offers nothing
    t.db.worker_stopped(w).await.expect("stopped");
    let out = stdout(&cli(Some(&t.url), &["status", &run]));
    assert!(out.contains("ok: no live worker offers"), "{out}");
}

/// `status --json` says the same as the table of a step no live worker
/// offers (time audit: only the table did), under the step's
/// `no_live_worker_offers`, and nothing for a step a live worker offers.
#[tokio::test]
async fn status_json_names_the_steps_no_live_worker_offers() {
    let t = TestDb::new().await;
    live_go_worker(&t, json!({})).await;
    let run = t
        .submit(json!({"name": "routes", "steps": [
            {"name": "ok", "executor_kind": "go", "kind": "demo.echo"},
            {"name": "gpu", "executor_kind": "go", "kind": "demo.echo", "labels": {"gpu": "a100"}}]}))
        .await
        .to_string();
    let o = cli(Some(&t.url), &["status", &run, "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: Value = serde_json::from_str(&stdout(&o)).expect("status --json");
    let needs = |name: &str| {
        v["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .find(|s| s["name"] == name)
            .map(|s| s.get("no_live_worker_offers").cloned())
            .expect("the step")
    };
    assert_eq!(needs("ok"), None, "{v}");
    assert_eq!(
        needs("gpu"),
        Some(json!(
            "executor_kind \"go\", kind \"demo.echo\", labels {\"gpu\":\"a100\"}"
        )),
        "{v}"
    );
}

/// A printing command whose reader went away ends quietly, as `cat` does
/// (`supervisor status ID | head -1`): it panicked on the write, printed a
/// backtrace and exited 101 (an outside audit).
#[tokio::test]
async fn a_closed_pipe_ends_a_printing_command_without_a_panic() {
    use std::os::unix::process::ExitStatusExt;
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "pipe", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k", "labels": {"gpu": "a100"}}]}))
        .await;
    for args in [vec!["status", &run.to_string()[..]], vec!["runs"]] {
        let mut child = Command::new(tests::supervisor_bin())
            .args(&args)
            .env("DATABASE_URL", &t.url)
            .env("RUST_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn supervisor");
        // the reader is gone before anything is written
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !err.contains("panicked") && out.status.code() != Some(101),
            "{args:?}: {:?}\n{err}",
            out.status
        );
        assert!(
            out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
            "{args:?}: {:?}\n{err}",
            out.status
        );
    }
}

/// `events --step` of a step a big run does not have names the first 20
/// of its steps and counts the rest (scale audit: a 1,000-step run's
/// message named all 1,000).
#[tokio::test]
async fn an_unknown_step_of_a_big_run_names_twenty_of_its_steps() {
    let t = TestDb::new().await;
    let steps: Vec<Value> = (1..=30)
        .map(|i| json!({"name": format!("s{i:02}"), "executor_kind": "go", "kind": "k"}))
        .collect();
    let run = t.submit(json!({"name": "big", "steps": steps})).await;
    let err =
        t.db.events(run, Some("nosuch"), None)
            .await
            .expect_err("no such step")
            .to_string();
    assert!(err.contains("has no step named \"nosuch\""), "{err}");
    assert!(err.contains("s01, s02") && err.contains("s20"), "{err}");
    assert!(!err.contains("s21"), "{err}");
    assert!(err.contains("and 10 more"), "{err}");
}

/// `cancel RUN --step NOSUCH` names the missing step (exit 4) while another
/// transaction holds the run's row: the step is looked for before the
/// run's lock is taken (it waited for the lock, then failed on its bound
/// with a lock error instead; re-check audit). A step the run has is
/// still cancelled under the lock, once the holder lets go.
#[tokio::test]
async fn cancelling_an_unknown_step_does_not_wait_for_the_runs_lock() {
    let t = TestDb::new().await;
    let run = t.submit(tests::one_step("x", "go", "k", json!({}))).await;
    let mut holder = t.db.pool().begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM durable.workflow_runs WHERE id = $1 FOR NO KEY UPDATE")
        .bind(run)
        .execute(&mut *holder)
        .await
        .expect("hold the run");
    let (url, id) = (t.url.clone(), run.to_string());
    let o =
        tokio::task::spawn_blocking(move || cli(Some(&url), &["cancel", &id, "--step", "nope"]))
            .await
            .expect("join");
    expect_exit(
        &o,
        4,
        &["no step named \"nope\""],
        "unknown step of a held run",
    );
    let unknown = Uuid::new_v4().to_string();
    let o = cli(Some(&t.url), &["cancel", &unknown, "--step", "nope"]);
    expect_exit(&o, 4, &["unknown run", &unknown], "unknown run with a step");

    // the step it has waits for the lock and is cancelled once it is free
    let (url, id) = (t.url.clone(), run.to_string());
    let cancel =
        tokio::task::spawn_blocking(move || cli(Some(&url), &["cancel", &id, "--step", "s"]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    holder.rollback().await.expect("let go");
    let o = cancel.await.expect("join");
    expect_exit(
        &o,
        0,
        &["cancellation requested"],
        "cancel of a step it has",
    );
    let state: String = sqlx::query_scalar("SELECT state FROM durable.step_runs WHERE run_id = $1")
        .bind(run)
        .fetch_one(t.db.pool())
        .await
        .expect("step");
    assert_eq!(state, "cancelled");
}

/// A worker is live while its last heartbeat is within three of its own
/// heartbeat intervals (at least 30 s): one beating every 50 s, 45 s after
/// its last beat, still offers its routes (routing audit: a fixed 30 s had
/// `status` say "no live worker offers" half the time while it ran them). A
/// worker registered without its interval keeps the 30 s rule.
#[tokio::test]
async fn a_worker_with_a_long_heartbeat_interval_stays_live_between_beats() {
    let t = TestDb::new().await;
    let caps = json!([{"executor": "go", "routes": [
        {"executor_kind": "go", "kind": "slow.beat", "labels": {}}]}]);
    let slow = uuid::Uuid::new_v4();
    t.db.register_worker_beating(slow, "slow", "test", &caps, Some(Duration::from_secs(50)))
        .await
        .expect("register");
    let run = t
        .submit(json!({"name": "beat", "steps": [{"name": "s", "executor_kind": "go", "kind": "slow.beat"}]}))
        .await;
    let beat_at = |ago: i32, id: uuid::Uuid| {
        let db = t.db.clone();
        async move {
            sqlx::query("UPDATE durable.workers SET last_heartbeat_at = now() - $1 * interval '1 second' WHERE id = $2")
                .bind(ago)
                .bind(id)
                .execute(db.pool())
                .await
                .expect("beat");
        }
    };
    beat_at(45, slow).await;
    assert!(
        t.db.unroutable_steps(run)
            .await
            .expect("unroutable")
            .is_empty(),
        "a worker 45 s after its last 50 s beat was taken for gone"
    );
    beat_at(151, slow).await;
    assert_eq!(
        t.db.unroutable_steps(run).await.expect("unroutable").len(),
        1
    );
    // without an interval (an older binary's row): 30 s
    t.db.worker_stopped(slow).await.expect("stopped");
    let old = uuid::Uuid::new_v4();
    t.db.register_worker(old, "old", "test", &caps)
        .await
        .expect("register");
    beat_at(20, old).await;
    assert!(t
        .db
        .unroutable_steps(run)
        .await
        .expect("unroutable")
        .is_empty());
    beat_at(45, old).await;
    assert_eq!(
        t.db.unroutable_steps(run).await.expect("unroutable").len(),
        1
    );
}

/// An ended step's error line says what its error alone does not: why a
/// retryable error was not retried (its deadline), and that a step whose
/// last attempt failed was then cancelled. Before, a step showed a
/// "retryable" ATTEMPT_TIMEOUT with attempts left and no word of its
/// deadline, and a cancelled step only its last failure (DAG and
/// cancellation audits).
#[tokio::test]
async fn status_says_why_an_ended_step_was_not_retried_or_was_cancelled() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "ends", "steps": [
            {"name": "dl", "executor_kind": "go", "kind": "k"},
            {"name": "later", "executor_kind": "go", "kind": "k"},
            {"name": "again", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let set = |q: &'static str| {
        let pool = t.db.pool().clone();
        async move {
            sqlx::query(q)
                .bind(run)
                .execute(&pool)
                .await
                .unwrap_or_else(|e| panic!("{q}: {e}"));
        }
    };
    set("UPDATE durable.step_runs SET state = 'leased', attempt = 1, lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 minute' WHERE run_id = $1").await;
    set("UPDATE durable.step_runs SET state = 'running' WHERE run_id = $1").await;
    set(
        "UPDATE durable.step_runs SET state = 'retryable_failed', error_code = 'DEMO_FAILURE',
                error_message = 'failing attempt 1', error_retryable = true,
                next_attempt_at = now() + interval '1 hour'
          WHERE run_id = $1 AND name = 'later'",
    )
    .await;
    // a step running again after an attempt that failed
    set(
        "UPDATE durable.step_runs SET error_code = 'LEASE_LOST', error_message = 'lost',
                error_retryable = true
          WHERE run_id = $1 AND name = 'again'",
    )
    .await;
    set("UPDATE durable.step_runs SET state = 'terminal_failed', error_code = 'ATTEMPT_TIMEOUT',
                error_message = 'the attempt ran past timeout_ms = 1500', error_retryable = true,
                transition_reason = 'ATTEMPT_TIMEOUT: the next attempt would start after the step deadline'
          WHERE run_id = $1 AND name = 'dl'").await;
    let o = cli(Some(&t.url), &["status", &run.to_string()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("dl: ATTEMPT_TIMEOUT: the attempt ran past timeout_ms = 1500 (not retried: the next attempt would start after the step deadline)"),
        "{text}"
    );
    assert!(
        text.contains("later: DEMO_FAILURE: failing attempt 1 (then cancelled: RUN_FAILED)"),
        "{text}"
    );
    // the running step's error is an earlier attempt's, and says so
    assert!(
        text.contains("again: LEASE_LOST (earlier attempt): lost"),
        "{text}"
    );
    let v = json_of(
        &cli(Some(&t.url), &["status", &run.to_string(), "--json"]),
        "status",
    );
    assert_eq!(
        v["steps"][0]["reason"],
        "ATTEMPT_TIMEOUT: the next attempt would start after the step deadline"
    );
    assert_eq!(v["steps"][1]["reason"], "RUN_FAILED");
    // and --json says so too
    assert_eq!(v["steps"][2]["error"]["earlier_attempt"], true, "{v}");
    assert!(
        v["steps"][0]["error"].get("earlier_attempt").is_none(),
        "{v}"
    );
}

/// On a schema older than the binary, the reading commands (and `cancel`)
/// refuse as `submit` does, naming `migrate`: they failed on the first
/// function the old schema lacked, with a raw SQL error, and `watch` said
/// the database was unreachable (upgrade audit). Here the newest migration
/// is taken out of the ledger.
#[tokio::test]
async fn the_reading_commands_name_migrate_on_an_older_schema() {
    let t = TestDb::new().await;
    let run = t
        .submit(tests::one_step("x", "go", "k", json!({})))
        .await
        .to_string();
    sqlx::query("DELETE FROM durable._sqlx_migrations WHERE version = $1")
        .bind(supervisor::db::Db::schema_version_needed())
        .execute(t.db.pool())
        .await
        .expect("an older ledger");
    // watch's 1 is a failed run: it could not follow this one (5), with no
    // hint to check a database that is fine
    for (args, code) in [
        (vec!["status", run.as_str()], 1),
        (vec!["events", run.as_str()], 1),
        (vec!["runs"], 1),
        (vec!["watch", run.as_str(), "--plain"], 5),
        (vec!["cancel", run.as_str()], 1),
        (vec!["artifact", "lineage", run.as_str()], 1),
    ] {
        let o = cli(Some(&t.url), &args);
        expect_exit(
            &o,
            code,
            &["this binary needs at least", "supervisor migrate"],
            &format!("{args:?}"),
        );
        assert!(
            !stderr(&o).contains("check the database"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

/// `events` without `--last` prints events as they are read, a page at a
/// time, instead of reading every one into memory first (600,000 events took
/// 526 MB, and `events | head` waited for all of them; operator's tools
/// audit). What it prints is what one read printed: one header, every event
/// in order; its JSON is the same array `--last` gives for all of them.
#[tokio::test]
async fn events_of_a_long_step_are_printed_as_read_and_in_order() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "long", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let n: i64 = 12_345;
    sqlx::query(
        "INSERT INTO durable.step_events (step_run_id, attempt, sequence, kind, message)
         SELECT s.id, 1, g, 'progress', 'event ' || g
           FROM durable.step_runs s, generate_series(1, $2::bigint) g WHERE s.run_id = $1",
    )
    .bind(run)
    .bind(n)
    .execute(t.db.pool())
    .await
    .expect("events");
    let id = run.to_string();
    let text = cli(Some(&t.url), &["events", &id]);
    assert_eq!(text.status.code(), Some(0), "{}", stderr(&text));
    let out = stdout(&text);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len() as i64, n + 1, "one header and every event");
    assert!(lines[0].starts_with("STEP"), "{}", lines[0]);
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("STEP")).count(),
        1,
        "one header"
    );
    for (i, l) in lines[1..].iter().enumerate() {
        assert!(l.ends_with(&format!("event {}", i + 1)), "row {i}: {l}");
    }
    let all = cli(Some(&t.url), &["events", &id, "--json"]);
    let last = cli(
        Some(&t.url),
        &["events", &id, "--json", "--last", &n.to_string()],
    );
    assert_eq!(all.status.code(), Some(0), "{}", stderr(&all));
    assert_eq!(
        stdout(&all),
        stdout(&last),
        "the streamed JSON is the one read's"
    );
    let v: Value = serde_json::from_str(&stdout(&all)).expect("JSON");
    assert_eq!(v.as_array().map(Vec::len), Some(n as usize));
    // and of a run without any: an empty array, as before
    let none = t
        .submit(json!({"name": "none", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let o = cli(Some(&t.url), &["events", &none.to_string(), "--json"]);
    assert_eq!(stdout(&o).trim(), "[]");
}

/// With `--log-format json`, a command's fatal error is a JSON log line too
/// (with its hint and exit code as fields): it was two plain lines,
/// `error: …` and `hint: …`, among the JSON ones (operator's tools audit).
#[tokio::test]
async fn a_fatal_error_in_the_json_log_format_is_a_json_line() {
    let o = Command::new(tests::supervisor_bin())
        .args([
            "--log-format",
            "json",
            "status",
            &Uuid::new_v4().to_string(),
        ])
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .expect("run supervisor");
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(!err.is_empty());
    let mut fatal = None;
    for line in err.lines() {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON line ({e}): {line:?}"));
        if v["level"] == "ERROR" && v["fields"]["exit_code"] == 1 {
            fatal = Some(v);
        }
    }
    let fatal = fatal.expect("the fatal error's line");
    assert!(
        fatal["fields"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("127.0.0.1")),
        "{fatal}"
    );
    assert!(fatal["fields"]["hint"].is_string() || fatal["fields"]["hint"].is_null());
}

/// A command line clap refuses is a JSON log line too under the JSON log
/// format, asked for by the flag or by `DURABLE_LOG_FORMAT`: it was clap's
/// plain lines among the JSON ones. Help stays plain text on stdout, and
/// without the JSON format the refusal is clap's usual text.
#[test]
fn a_usage_error_in_the_json_log_format_is_a_json_line() {
    let run = |args: &[&str], env_json: bool| {
        let mut c = Command::new(tests::supervisor_bin());
        c.args(args).env_remove("RUST_LOG").stdin(Stdio::null());
        if env_json {
            c.env("DURABLE_LOG_FORMAT", "json");
        } else {
            c.env_remove("DURABLE_LOG_FORMAT");
        }
        c.output().expect("run supervisor")
    };
    for (args, env_json) in [
        (&["--log-format", "json", "stauts"][..], false),
        (&["--log-format=json", "status"][..], false),
        (&["runs", "--limit", "x"][..], true),
        (&["--log-format", "json"][..], false),
    ] {
        let o = run(args, env_json);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        let lines: Vec<&str> = err.lines().collect();
        assert_eq!(lines.len(), 1, "{args:?}: one line: {err}");
        let v: Value = serde_json::from_str(lines[0])
            .unwrap_or_else(|e| panic!("{args:?}: not a JSON line ({e}): {err:?}"));
        assert_eq!(v["level"], "ERROR", "{v}");
        assert_eq!(v["fields"]["exit_code"], 2, "{v}");
        let message = v["fields"]["message"].as_str().unwrap_or_default();
        assert!(!message.is_empty() && !message.starts_with("error:"), "{v}");
        assert!(v["fields"]["hint"].is_string(), "{v}");
    }
    let o = run(&["--log-format", "json", "stauts"], false);
    assert!(
        stderr(&o).contains("unrecognized subcommand 'stauts'"),
        "{}",
        stderr(&o)
    );
    // the text format, and help, are clap's own
    let o = run(&["stauts"], false);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).starts_with("error: unrecognized subcommand"),
        "{}",
        stderr(&o)
    );
    let o = run(&["--log-format", "json", "--help"], false);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("Usage: supervisor"), "{}", stdout(&o));
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    // `--log-format text` after the variable wins over it
    let o = run(&["--log-format", "text", "stauts"], true);
    assert!(stderr(&o).starts_with("error: "), "{}", stderr(&o));
}

/// `status --json` names each step's worker: the one that holds its lease
/// or held its last (README "Many hosts": a worker's name is the owner);
/// `null` for a step never leased. It was only in `durable.transitions`
/// (new developer's audit).
#[tokio::test]
async fn status_names_the_worker_of_each_step() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "who", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}))
        .await;
    let w = Uuid::new_v4();
    t.db.register_worker(w, "eu-1a", "test", &json!([]))
        .await
        .expect("register");
    let a =
        t.db.lease(w, "eu-1a", &tests::route_go_k(), 1, Duration::from_secs(30))
            .await
            .expect("lease")
            .remove(0);
    let o = cli(Some(&t.url), &["status", &run.to_string(), "--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    assert_eq!(v["steps"][0]["worker"], "eu-1a", "{v}");
    t.db.mark_running(&a.lease, "eu-1a", 1, &tests::accepted_event())
        .await
        .expect("running");
    t.db.complete(&a.lease, "eu-1a", &json!({}), &[], Some(2))
        .await
        .expect("complete");
    let o = cli(Some(&t.url), &["status", &run.to_string(), "--json"]);
    let v: Value = serde_json::from_str(&stdout(&o)).expect("JSON");
    let steps = v["steps"].as_array().expect("steps");
    let by = |n: &str| steps.iter().find(|s| s["name"] == n).cloned().expect(n);
    assert_eq!(by("a")["worker"], "eu-1a", "the worker that ran it: {v}");
    assert!(by("b")["worker"].is_null(), "never leased: {v}");
}
