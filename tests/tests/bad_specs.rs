//! Malformed specs: each is rejected with a message that names the problem,
//! through the CLI (exit 2) and through the SQL function, and nothing is written.

use std::process::Command;

use serde_json::{json, Value};
use supervisor::db::DbError;
use tests::TestDb;

fn step() -> Value {
    json!({"name": "a", "executor_kind": "go", "kind": "demo.echo"})
}

fn with_step(f: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Value {
    let mut s = step();
    if let Value::Object(m) = &mut s {
        f(m);
    }
    json!({"name": "bad", "steps": [s]})
}

/// (what, spec text, a fragment the error must contain)
fn cases() -> Vec<(&'static str, String, &'static str)> {
    let big = "x".repeat(1_100_000);
    let v = |v: Value| v.to_string();
    vec![
        ("not JSON", "{\"name\": ".to_string(), "not JSON"),
        (
            "not an object",
            v(json!([1, 2])),
            "spec: must be a JSON object",
        ),
        (
            "missing name",
            v(json!({"steps": [step()]})),
            "name: is required",
        ),
        (
            "blank idempotency key",
            v(json!({"name": "r", "idempotency_key": " \t ", "steps": [step()]})),
            "idempotency_key: must not be empty or blank",
        ),
        (
            "name of the wrong type",
            v(json!({"name": 7, "steps": [step()]})),
            "name: must be a string",
        ),
        (
            "missing steps",
            v(json!({"name": "x"})),
            "steps: is required",
        ),
        (
            "empty steps",
            v(json!({"name": "x", "steps": []})),
            "steps: must contain at least one step",
        ),
        (
            "steps not an array",
            v(json!({"name": "x", "steps": {"a": 1}})),
            "steps: must be an array",
        ),
        (
            "unknown top-level field",
            v(json!({"name": "x", "stepz": [], "steps": [step()]})),
            "spec.stepz: unknown field",
        ),
        (
            "missing executor_kind",
            v(with_step(|m| {
                m.remove("executor_kind");
            })),
            "steps[0].executor_kind: is required",
        ),
        (
            "missing kind",
            v(with_step(|m| {
                m.remove("kind");
            })),
            "steps[0].kind: is required",
        ),
        (
            "empty step name",
            v(with_step(|m| {
                m.insert("name".into(), json!(""));
            })),
            "steps[0].name: must not be empty",
        ),
        (
            "duplicate step names",
            v(json!({"name": "x", "steps": [step(), step()]})),
            "steps[1].name: duplicate step name \"a\"",
        ),
        (
            "unknown dependency",
            v(with_step(|m| {
                m.insert("depends_on".into(), json!(["nope"]));
            })),
            "steps[0].depends_on[0]: unknown step \"nope\"",
        ),
        (
            "self dependency",
            v(with_step(|m| {
                m.insert("depends_on".into(), json!(["a"]));
            })),
            "a step cannot depend on itself",
        ),
        (
            "cycle",
            v(json!({"name": "x", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k", "depends_on": ["c"]},
            {"name": "b", "executor_kind": "go", "kind": "k", "depends_on": ["a"]},
            {"name": "c", "executor_kind": "go", "kind": "k", "depends_on": ["b"]}]})),
            r#"steps[0].depends_on: dependency cycle: "a" → "c" → "b" → "a""#,
        ),
        // a step that only depends on a cycle is not in it: it was named, and
        // listed with the cycle's steps
        (
            "cycle behind a dependent",
            v(json!({"name": "x", "steps": [
            {"name": "u", "executor_kind": "go", "kind": "k", "depends_on": ["s"]},
            {"name": "s", "executor_kind": "go", "kind": "k", "depends_on": ["t"]},
            {"name": "t", "executor_kind": "go", "kind": "k", "depends_on": ["s"]},
            {"name": "v", "executor_kind": "go", "kind": "k", "depends_on": ["u"]}]})),
            r#"steps[1].depends_on: dependency cycle: "s" → "t" → "s" (each depends on the next)"#,
        ),
        (
            "a label name of tabs",
            v(with_step(|m| {
                m.insert("labels".into(), json!({"\t\n": "gpu"}));
            })),
            "steps[0].labels: a label name must not be empty or blank",
        ),
        // routing fields are matched byte for byte against hellos (audit
        // 91: these were accepted and the step waited for ever), and labels
        // go into the routing index (a large set was refused by it with a
        // raw database error, exit 1)
        (
            "executor_kind with a trailing space",
            v(with_step(|m| {
                m.insert("executor_kind".into(), json!("go "));
            })),
            "steps[0].executor_kind: must not contain control characters nor begin or end with whitespace",
        ),
        (
            "executor_kind with a C1 control",
            v(with_step(|m| {
                m.insert("executor_kind".into(), json!("go\u{85}"));
            })),
            "steps[0].executor_kind: must not contain control characters",
        ),
        // Unicode's whitespace, whatever the database's locale (a92: a
        // C-locale database took U+3000 for a letter)
        (
            "kind ending in an ideographic space",
            v(with_step(|m| {
                m.insert("kind".into(), json!("demo.echo\u{3000}"));
            })),
            "steps[0].kind: must not contain control characters nor begin or end with whitespace",
        ),
        (
            "executor_kind starting with a no-break space",
            v(with_step(|m| {
                m.insert("executor_kind".into(), json!("\u{a0}go"));
            })),
            "steps[0].executor_kind: must not contain control characters nor begin or end with whitespace",
        ),
        (
            "kind with a tab",
            v(with_step(|m| {
                m.insert("kind".into(), json!("demo.\techo"));
            })),
            "steps[0].kind: must not contain control characters nor begin or end with whitespace",
        ),
        (
            "a label name with a newline",
            v(with_step(|m| {
                m.insert("labels".into(), json!({"a\nb": "x"}));
            })),
            r#"steps[0].labels: a label name must not contain control characters nor begin or end with whitespace: "a\nb""#,
        ),
        (
            "a label value with a bell",
            v(with_step(|m| {
                m.insert("labels".into(), json!({"gpu": "a\u{7}"}));
            })),
            "steps[0].labels.gpu: must not contain control characters",
        ),
        (
            "labels over 1 KiB",
            v(with_step(|m| {
                let many: serde_json::Map<String, Value> = (0..200)
                    .map(|i| (format!("l{i}"), json!("v")))
                    .collect();
                m.insert("labels".into(), Value::Object(many));
            })),
            "steps[0].labels: is larger than 1 KiB as stored (",
        ),
        (
            "labels not strings",
            v(with_step(|m| {
                m.insert("labels".into(), json!({"zone": 1}));
            })),
            "steps[0].labels.zone: must be a string",
        ),
        (
            "max_attempts zero",
            v(with_step(|m| {
                m.insert("retry".into(), json!({"max_attempts": 0}));
            })),
            "steps[0].retry.max_attempts: must be between 1 and 1000",
        ),
        (
            // quoted cut short, not spelled out in 401 digits
            "max_attempts astronomically large",
            with_step(|m| {
                m.insert("retry".into(), json!({"max_attempts": 1}));
            })
            .to_string()
            .replace("\"max_attempts\":1", "\"max_attempts\":1e400"),
            "steps[0].retry.max_attempts: must be between 1 and 1000, got 100000000000… (401 characters)",
        ),
        (
            "a step name that is not ASCII",
            v(json!({"name": "x", "steps": [{"name": "é", "executor_kind": "go", "kind": "k"}]})),
            "steps[0].name: may contain only ASCII letters",
        ),
        (
            // 201 steps of 100 dependencies each: 20,100
            "more than 20,000 dependencies",
            v(json!({"name": "x", "steps": (0..201)
                .map(|i| json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "k",
                                "depends_on": (0..100).map(|j| format!("d{j}")).collect::<Vec<_>>()}))
                .chain((0..100).map(|j| json!({"name": format!("d{j}"), "executor_kind": "go", "kind": "k"})))
                .collect::<Vec<_>>()})),
            "steps[200].depends_on: the run has more than 20,000 dependencies (depends_on entries) in all",
        ),
        (
            "backoff below one",
            v(with_step(|m| {
                m.insert("retry".into(), json!({"backoff_coefficient": 0.5}));
            })),
            "steps[0].retry.backoff_coefficient: must be between 1 and 100",
        ),
        (
            "max interval below initial",
            v(with_step(|m| {
                m.insert(
                    "retry".into(),
                    json!({"initial_interval_ms": 5000, "max_interval_ms": 10}),
                );
            })),
            "steps[0].retry.max_interval_ms: must be at least initial_interval_ms",
        ),
        (
            // the user wrote no initial interval: the message says whose
            // value it is
            "max interval below the default initial",
            v(with_step(|m| {
                m.insert("retry".into(), json!({"max_interval_ms": 0}));
            })),
            "steps[0].retry.max_interval_ms: must be at least initial_interval_ms (1000 by default;",
        ),
        (
            // matched exactly, it would never match the BAD_INPUT an SDK sends
            "a lower-case non-retryable code",
            v(with_step(|m| {
                m.insert(
                    "retry".into(),
                    json!({"non_retryable_codes": ["QUOTA", "bad_input"]}),
                );
            })),
            r#"steps[0].retry.non_retryable_codes[1]: "bad_input" is not an error code: codes are UPPER_SNAKE_CASE (capital letters, digits and _), as executors send them; did you mean "BAD_INPUT"?"#,
        ),
        (
            "a non-retryable code with a dash",
            v(with_step(|m| {
                m.insert("retry".into(), json!({"non_retryable_codes": ["Bad-Input"]}));
            })),
            r#"steps[0].retry.non_retryable_codes[0]: "Bad-Input" is not an error code: codes are UPPER_SNAKE_CASE (capital letters, digits and _), as executors send them; did you mean "BAD_INPUT"?"#,
        ),
        (
            "an empty non-retryable code",
            v(with_step(|m| {
                m.insert("retry".into(), json!({"non_retryable_codes": [""]}));
            })),
            r#"steps[0].retry.non_retryable_codes[0]: "" is not an error code"#,
        ),
        (
            "unknown retry field",
            v(with_step(|m| {
                m.insert("retry".into(), json!({"attempts": 3}));
            })),
            "steps[0].retry.attempts: unknown field",
        ),
        (
            "timeout not an integer",
            v(with_step(|m| {
                m.insert("timeout_ms".into(), json!("10s"));
            })),
            "steps[0].timeout_ms: must be an integer",
        ),
        (
            "negative heartbeat timeout",
            v(with_step(|m| {
                m.insert("heartbeat_timeout_ms".into(), json!(-5));
            })),
            "steps[0].heartbeat_timeout_ms: must be between 1",
        ),
        (
            "deadline not a timestamp",
            v(with_step(|m| {
                m.insert("deadline".into(), json!("tomorrow"));
            })),
            "steps[0].deadline: must be an RFC 3339 timestamp",
        ),
        (
            "secret-looking input key",
            v(with_step(|m| {
                m.insert("input".into(), json!({"db": {"Password": "hunter2"}}));
            })),
            "steps[0].input.db.Password: looks like a secret",
        ),
        (
            "api_key in a list",
            v(with_step(|m| {
                m.insert("input".into(), json!({"items": [{"my_api_key": "k"}]}));
            })),
            "steps[0].input.items[0].my_api_key: looks like a secret",
        ),
        (
            "bad secret name",
            v(with_step(|m| {
                m.insert("secrets".into(), json!(["not-a-name"]));
            })),
            "steps[0].secrets[0]: must be a secret name",
        ),
        (
            "huge input",
            v(with_step(|m| {
                m.insert("input".into(), json!({"blob": big}));
            })),
            "steps[0].input: is larger than 1 MiB",
        ),
        (
            "wrong type for a step",
            v(json!({"name": "x", "steps": ["a"]})),
            "steps[0]: must be an object",
        ),
        (
            "camelCase api key",
            v(with_step(|m| {
                m.insert("input".into(), json!({"auth": {"apiKey": "sk-1"}}));
            })),
            "steps[0].input.auth.apiKey: looks like a secret",
        ),
        (
            "dashed api key header",
            v(with_step(|m| {
                m.insert("input".into(), json!({"headers": {"X-Api-Key": "k"}}));
            })),
            "steps[0].input.headers.X-Api-Key: looks like a secret",
        ),
        (
            "camelCase private key",
            v(with_step(|m| {
                m.insert("input".into(), json!({"privateKey": "-----BEGIN"}));
            })),
            "steps[0].input.privateKey: looks like a secret",
        ),
        (
            "blank kind",
            v(with_step(|m| {
                m.insert("kind".into(), json!("   "));
            })),
            "steps[0].kind: must not be blank",
        ),
        (
            "empty label name",
            v(with_step(|m| {
                m.insert("labels".into(), json!({"": "a"}));
            })),
            "steps[0].labels: a label name must not be empty",
        ),
        (
            "NUL in an input string",
            v(with_step(|m| {
                m.insert("input".into(), json!({"s": "a\u{0}b"}));
            })),
            "steps[0].input.s: contains a NUL character",
        ),
        (
            "hour 24 in a deadline",
            v(with_step(|m| {
                m.insert("deadline".into(), json!("2030-01-01T24:00:00Z"));
            })),
            "steps[0].deadline: must be an RFC 3339 timestamp",
        ),
        (
            "fractional timeout",
            v(with_step(|m| {
                m.insert("timeout_ms".into(), json!(1000.5));
            })),
            "steps[0].timeout_ms: must be an integer",
        ),
        (
            "input nested too deeply for the CLI",
            format!(
                r#"{{"name": "deep", "steps": [{{"name": "a", "executor_kind": "go", "kind": "k", "input": {}{}}}]}}"#,
                "[".repeat(200),
                "]".repeat(200)
            ),
            "an input nests at most 128 levels",
        ),
        // numbers jsonb cannot hold: the database refused the whole value
        // with a raw error (exit 1) naming nothing
        (
            "a number too large for numeric in the input",
            r#"{"name": "n", "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "input": {"x": [1, {"n": 1e999999}]}}]}"#.to_string(),
            "steps[0].input.x[1].n: the number 1e+999999 cannot be stored",
        ),
        (
            "a number too precise for numeric in the input",
            r#"{"name": "n", "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "input": {"n": 1e-1000000}}]}"#.to_string(),
            "steps[0].input.n: the number",
        ),
        (
            "a timeout too large for numeric",
            r#"{"name": "n", "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "timeout_ms": 1e1000000}]}"#.to_string(),
            "steps[0].timeout_ms: the number",
        ),
    ]
}

/// `[[[…]]]`, `depth` arrays deep (built without a parser's recursion limit).
fn nested(depth: usize) -> Value {
    (0..depth).fold(json!([]), |inner, _| Value::Array(vec![inner]))
}

#[tokio::test]
async fn input_nested_deeper_than_the_limit_is_a_spec_error_through_sql() {
    let t = TestDb::new().await;
    for depth in [129, 1000] {
        let spec = json!({"name": "deep", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k", "input": {"x": nested(depth)}}]});
        match t.db.submit(&spec).await {
            Err(DbError::InvalidSpec(msg)) => assert!(
                msg.contains("is nested more than 128 levels deep")
                    && msg.starts_with("steps[0].input.x"),
                "depth {depth}: {msg}"
            ),
            other => panic!("depth {depth}: {other:?}"),
        }
    }
    // 100 levels are fine
    let spec = json!({"name": "deep", "steps": [
        {"name": "a", "executor_kind": "go", "kind": "k", "input": nested(100)}]});
    t.db.submit(&spec).await.expect("100 levels deep");
}

/// What the contract allows is accepted, in the form it was written: a whole
/// number written as a float, RFC 3339's lowercase `t` and `z`, a UTF-8 byte
/// order mark before the JSON.
#[tokio::test]
async fn integral_floats_lowercase_timestamps_and_a_bom_are_accepted() {
    let t = TestDb::new().await;
    let text =
        "\u{feff}{\"name\": \"ok\", \"steps\": [{\"name\": \"a\", \"executor_kind\": \"go\", \
                \"kind\": \"k\", \"timeout_ms\": 1000.0, \"heartbeat_timeout_ms\": 5e3, \
                \"retry\": {\"max_attempts\": 3.0, \"max_interval_ms\": 1e4}, \
                \"deadline\": \"2030-01-01t00:00:00z\"}]}";
    let out = tests::submit_stdin(&t.url, text);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (timeout, hb, attempts, max_interval, deadline): (i64, i64, i64, i64, String) =
        sqlx::query_as(
            "SELECT timeout_ms, heartbeat_timeout_ms, (retry->>'max_attempts')::bigint,
                    (retry->>'max_interval_ms')::bigint,
                    to_char(deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI')
               FROM durable.step_runs",
        )
        .fetch_one(t.db.pool())
        .await
        .expect("the step");
    assert_eq!(
        (timeout, hb, attempts, max_interval, deadline.as_str()),
        (1000, 5000, 3, 10_000, "2030-01-01 00:00")
    );
}

#[tokio::test]
async fn a_url_that_is_not_postgres_is_refused_with_exit_2() {
    let bin = tests::supervisor_bin();
    for url in ["mysql://u@localhost/db", "http://localhost/db"] {
        let out = Command::new(&bin)
            .args(["runs"])
            .env("DATABASE_URL", url)
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert!(
            stderr.contains("postgres://"),
            "{url}: the message should say what a URL looks like: {stderr}"
        );
    }
}

/// A URL parameter the driver does not know is named, never its value: the
/// driver logged `sslpassword=…` in clear, whatever the log level
/// (security audit).
#[tokio::test]
async fn an_unknown_url_parameter_is_named_without_its_value() {
    let t = TestDb::new().await;
    let url = format!(
        "{}{}sslpassword=KeyPW123",
        t.url,
        if t.url.contains('?') { "&" } else { "?" }
    );
    for level in ["info", "trace"] {
        let out = Command::new(tests::supervisor_bin())
            .args(["runs"])
            .env("DATABASE_URL", &url)
            .env("RUST_LOG", level)
            .output()
            .expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert!(!stderr.contains("KeyPW123"), "{level}: {stderr}");
        assert!(
            stderr.contains("parameter=sslpassword"),
            "{level}: {stderr}"
        );
    }
}

/// Cancelling a finished run says so (and still exits 0); a step the run does
/// not have is exit 4 whatever the run's state.
#[tokio::test]
async fn cancel_of_a_finished_run_says_so_and_refuses_an_unknown_step() {
    let t = TestDb::new().await;
    let bin = tests::supervisor_bin();
    let run = t
        .submit(tests::one_step("c", "go", "demo.echo", json!({})))
        .await
        .to_string();
    let cancel = |extra: &[&str]| {
        let mut args = vec!["cancel", run.as_str()];
        args.extend_from_slice(extra);
        let out = Command::new(&bin)
            .args(&args)
            .env("DATABASE_URL", &t.url)
            .output()
            .expect("cancel");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, msg) = cancel(&[]);
    assert_eq!(code, Some(0), "{msg}");
    assert!(
        msg.contains("cancellation requested; run is cancelled"),
        "{msg}"
    );
    let (code, msg) = cancel(&[]);
    assert_eq!(code, Some(0), "{msg}");
    assert!(
        msg.contains("already cancelled; nothing to cancel"),
        "{msg}"
    );
    let (code, msg) = cancel(&["--step", "nope"]);
    assert_eq!(code, Some(4), "{msg}");
    assert!(msg.contains("has no step named \"nope\""), "{msg}");
    // and names the run's steps, as `events --step` does
    assert!(msg.contains("; its steps are: "), "{msg}");
    // what the user typed is quoted back without its control characters
    // (an escape sequence that clears the screen was echoed as it is)
    let (code, msg) = cancel(&["--step", "\u{1b}[2Jzz"]);
    assert_eq!(code, Some(4), "{msg}");
    assert!(msg.contains("has no step named \"\\u{1b}[2Jzz\""), "{msg}");
    assert!(!msg.contains('\u{1b}'), "{msg:?}");
}

#[tokio::test]
async fn every_malformed_spec_is_rejected_with_a_message_naming_it_and_nothing_is_written() {
    let t = TestDb::new().await;
    let cases = cases();
    assert!(cases.len() >= 15);
    for (what, text, fragment) in &cases {
        // through the CLI, from stdin
        let out = tests::submit_stdin(&t.url, text);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{what}: exit code; stderr: {stderr}"
        );
        assert!(
            stderr.contains(fragment),
            "{what}: message {stderr:?} does not contain {fragment:?}"
        );
        assert!(out.stdout.is_empty(), "{what}: printed a run id");

        // through the SQL function
        if let Ok(spec) = serde_json::from_str::<Value>(text) {
            match t.db.submit(&spec).await {
                Err(DbError::InvalidSpec(msg)) => {
                    assert!(
                        msg.contains(fragment),
                        "{what}: SQL message {msg:?} lacks {fragment:?}"
                    )
                }
                other => panic!("{what}: SQL submit returned {other:?}"),
            }
        }
        println!("rejected: {what:<28} {fragment}");
    }
    for table in ["workflow_runs", "step_defs", "step_runs", "transitions"] {
        assert_eq!(
            t.scalar_i64(&format!("SELECT count(*) FROM durable.{table}"))
                .await,
            0,
            "{table} must stay empty"
        );
    }
}

#[tokio::test]
async fn a_secret_reference_is_accepted_and_named_for_the_worker() {
    let t = TestDb::new().await;
    let run = t
        .submit(json!({"name": "ok", "steps": [{"name": "a", "executor_kind": "go", "kind": "k",
            "input": {"db": {"password": {"$secret": "DB_PASSWORD"}}}, "secrets": ["REPORT_API_TOKEN"]}]}))
        .await;
    let secrets: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(secrets) FROM durable.step_runs WHERE run_id = $1 ORDER BY 1",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("secrets");
    assert_eq!(secrets, vec!["DB_PASSWORD", "REPORT_API_TOKEN"]);
}

/// Every secret a step names or its input references (at any depth, in
/// arrays, the input itself a reference) is kept once, sorted; the first
/// name that is not one is the one named. 20,000 of each, as the scale
/// audit's specs, are taken (their check was quadratic: 6.3 s and 3.2 s).
#[tokio::test]
async fn secret_names_and_references_are_gathered_once_each() {
    let t = TestDb::new().await;
    let many: Vec<String> = (0..20_000).map(|i| format!("S{i}")).collect();
    let refs: Vec<Value> = many.iter().map(|s| json!({"$secret": s})).collect();
    let run = t
        .submit(json!({"name": "ok", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k", "secrets": ["B", "A", "B"],
             "input": {"list": [{"$secret": "C"}, [{"$secret": "A"}], {"k": {"$secret": "D"}}],
                       "x": {"$secret": "C"}}},
            {"name": "b", "executor_kind": "go", "kind": "k", "input": {"$secret": "E"}},
            {"name": "c", "executor_kind": "go", "kind": "k", "secrets": many, "input": refs}]}))
        .await;
    let secrets: Vec<(String, Vec<String>)> = sqlx::query_as(
        "SELECT name, secrets FROM durable.step_defs WHERE run_id = $1 ORDER BY name",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("secrets");
    let mut sorted = many.clone();
    sorted.sort();
    assert_eq!(
        secrets,
        vec![
            (
                "a".into(),
                vec!["A".into(), "B".into(), "C".into(), "D".into()]
            ),
            ("b".into(), vec!["E".into()]),
            ("c".into(), sorted),
        ]
    );
    let err =
        t.db.submit(
            &json!({"name": "bad", "steps": [{"name": "a", "executor_kind": "go", "kind": "k",
            "secrets": ["A", "B", "not-a-name", 7]}]}),
        )
        .await
        .expect_err("a bad name")
        .to_string();
    assert!(
        err.contains("steps[0].secrets[2]: must be a secret name"),
        "{err}"
    );
}

#[tokio::test]
async fn status_and_cancel_of_an_unknown_run_exit_4() {
    let t = TestDb::new().await;
    let bin = tests::supervisor_bin();
    let id = uuid::Uuid::new_v4().to_string();
    for args in [
        vec!["status", id.as_str(), "--json"],
        vec!["cancel", id.as_str()],
        vec!["status", "not-a-uuid"],
    ] {
        let out = Command::new(&bin)
            .args(&args)
            .env("DATABASE_URL", &t.url)
            .output()
            .expect("run");
        assert_eq!(
            out.status.code(),
            Some(4),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // a valid spec through the CLI prints {"run_id": ...} and status finds it
    let spec = tempfile::NamedTempFile::new().expect("tmp");
    std::fs::write(
        spec.path(),
        tests::one_step("cli", "go", "demo.echo", json!({"a": 1})).to_string(),
    )
    .expect("write");
    let out = Command::new(&bin)
        .args(["submit", spec.path().to_str().expect("path"), "--json"])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("submit");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    let run = v["run_id"].as_str().expect("run_id").to_string();
    let out = Command::new(&bin)
        .args(["status", &run, "--json"])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("status");
    assert_eq!(out.status.code(), Some(0));
    let st: Value = serde_json::from_slice(&out.stdout).expect("status json");
    assert_eq!(st["state"], "pending");
    assert_eq!(st["steps"][0]["name"], "s");
    assert_eq!(st["steps"][0]["state"], "pending");
    assert_eq!(st["steps"][0]["attempt"], 0);
    for key in [
        "step_run_id",
        "executor_kind",
        "kind",
        "events",
        "artifacts",
        "error",
    ] {
        assert!(st["steps"][0].get(key).is_some(), "status lacks {key}");
    }
    assert_eq!(st["steps"][0]["error"], Value::Null, "no error yet: null");
    let out = Command::new(&bin)
        .args(["cancel", &run])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("cancel");
    assert_eq!(out.status.code(), Some(0));
    let out = Command::new(&bin)
        .args(["status", &run, "--json"])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("status");
    let st: Value = serde_json::from_slice(&out.stdout).expect("status json");
    assert_eq!(st["state"], "cancelled");
}

/// A spec whose idempotency key names an existing run is validated as a whole
/// all the same: an invalid one is refused with the field it names (exit 2,
/// and through SQL), and nothing is written. Before the fix the known key
/// returned the first run's id at once, so `"steps": "notanarray"` (or a step
/// with a bad field) was accepted with exit 0. A valid spec with that key
/// still returns the first run's id.
#[tokio::test]
async fn a_known_idempotency_key_does_not_let_an_invalid_spec_through() {
    let t = TestDb::new().await;
    let good = json!({"name": "once", "idempotency_key": "k1", "steps": [step()]});
    let first = t.submit(good.clone()).await;
    let bad_specs = [
        (
            json!({"name": "once", "idempotency_key": "k1", "steps": "notanarray"}),
            "steps",
        ),
        (
            json!({"name": "once", "idempotency_key": "k1",
                   "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "timeout_ms": "soon"}]}),
            "steps[0].timeout_ms",
        ),
        (
            json!({"name": "once", "idempotency_key": "k1",
                   "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "depends_on": ["a"]}]}),
            "steps[0].depends_on[0]",
        ),
    ];
    for (spec, field) in &bad_specs {
        let out = tests::submit_stdin(&t.url, &spec.to_string());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{spec}: stderr {stderr}");
        assert!(stderr.contains(field), "{spec}: {stderr}");
        match t.db.submit(spec).await {
            Err(DbError::InvalidSpec(msg)) => assert!(msg.contains(field), "{msg}"),
            other => panic!("{spec}: SQL submit returned {other:?}"),
        }
    }
    assert_eq!(t.submit(good).await, first, "the same key: the same run");
    for (table, want) in [("workflow_runs", 1), ("step_defs", 1), ("step_runs", 1)] {
        assert_eq!(
            t.scalar_i64(&format!("SELECT count(*) FROM durable.{table}"))
                .await,
            want,
            "{table}: nothing more was written"
        );
    }
}

/// A submit whose idempotency key names a run that exists says so on stderr:
/// a retried submit of the same spec that nothing new was submitted, and a
/// changed spec that it was NOT submitted (before, both exited 0 with the
/// first run's id and said nothing, and a changed spec was silently dropped).
/// The id on stdout and the exit code stay what CONTRACT §3 promises, and SQL
/// callers read the same outcome from `durable.submit_outcome`.
#[tokio::test]
async fn a_known_idempotency_key_says_whether_this_spec_was_submitted() {
    let t = TestDb::new().await;
    let first_spec = json!({"name": "once", "idempotency_key": "k1", "steps": [step()]});
    let out = tests::submit_stdin(&t.url, &first_spec.to_string());
    let run_id = |out: &std::process::Output| {
        let v: Value = serde_json::from_slice(&out.stdout).expect("submit --json prints JSON");
        v["run_id"].as_str().expect("run_id").to_owned()
    };
    let first = run_id(&out);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        out.stderr.is_empty(),
        "a new run: nothing on stderr, got {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let out = tests::submit_stdin(&t.url, &first_spec.to_string());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(run_id(&out), first);
    assert!(
        stderr.contains(&format!(
            "idempotency key \"k1\" already names run {first}, made from this same spec: nothing new was submitted"
        )),
        "{stderr}"
    );

    let changed = json!({"name": "twice", "idempotency_key": "k1", "steps": [step()]});
    let out = tests::submit_stdin(&t.url, &changed.to_string());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert_eq!(run_id(&out), first);
    assert!(
        stderr.contains(&format!(
            "warning: idempotency key \"k1\" already names run {first}, made from a different spec: this spec was NOT submitted"
        )),
        "{stderr}"
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        1,
        "no second run"
    );

    // through SQL, in the caller's transaction
    let mut tx = t.db.pool().begin().await.expect("begin");
    let id: uuid::Uuid = sqlx::query_scalar("SELECT durable.submit_run($1)")
        .bind(&changed)
        .fetch_one(&mut *tx)
        .await
        .expect("submit through SQL");
    assert_eq!(id.to_string(), first);
    let outcome: Option<String> =
        sqlx::query_scalar("SELECT current_setting('durable.submit_outcome', true)")
            .fetch_one(&mut *tx)
            .await
            .expect("read the outcome");
    assert_eq!(outcome.as_deref(), Some("known, other spec"));
    tx.rollback().await.expect("rollback");
}

/// A run of two steps `a` and `b` (executor_kind go, kind k), `n` of them
/// leased by a worker named `w`.
async fn two_steps_leased(t: &TestDb, n: u32) -> (uuid::Uuid, Vec<supervisor::db::LeasedStep>) {
    let run = t
        .submit(json!({"name": "two", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "k"},
            {"name": "b", "executor_kind": "go", "kind": "k"}]}))
        .await;
    let wid = uuid::Uuid::new_v4();
    t.db.register_worker(wid, "w", "test", &json!([]))
        .await
        .expect("register");
    let leased =
        t.db.lease(
            wid,
            "w",
            &tests::route_go_k(),
            n,
            std::time::Duration::from_secs(30),
        )
        .await
        .expect("lease");
    (run, leased)
}

/// `cancel RUN --step NAME` of a step that already ended says so, and the run
/// goes on: before, it answered "cancellation requested; run is running" as
/// if the finished step had been cancelled.
#[tokio::test]
async fn cancel_of_a_finished_step_says_nothing_was_cancelled() {
    let t = TestDb::new().await;
    let (run, leased) = two_steps_leased(&t, 1).await;
    let a = &leased[0];
    t.db.complete(&a.lease, "w", &json!({}), &[], Some(2))
        .await
        .expect("complete");
    let st = t.status(run).await;
    let done = st
        .steps
        .iter()
        .find(|s| s.state == "succeeded")
        .expect("a step succeeded");
    let (name, other) = (done.name.clone(), if done.name == "a" { "b" } else { "a" });
    let out = Command::new(tests::supervisor_bin())
        .args(["cancel", &run.to_string(), "--step", &name])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("cancel");
    let msg = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{msg}");
    assert!(
        msg.contains(&format!(
            "step {name} already succeeded; nothing to cancel (run is running)"
        )),
        "{msg}"
    );
    let st = t.status(run).await;
    assert_eq!(st.state, "running");
    assert_eq!(tests::step(&st, other).state, "pending");
}

/// A run key that is the id of a run submitted without a key is refused:
/// each step's idempotency key is `<run key or run id>/<step>`, so both runs'
/// steps would have had the same keys, and a side effect keyed on them done
/// for one would be skipped as a duplicate for the other.
#[tokio::test]
async fn a_run_key_that_is_another_runs_id_is_refused() {
    let t = TestDb::new().await;
    let first = t
        .submit(json!({"name": "a", "steps": [step()]}))
        .await
        .to_string();
    let spec = json!({"name": "b", "idempotency_key": first, "steps": [step()]});
    let out = tests::submit_stdin(&t.url, &spec.to_string());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("idempotency_key: is the id of another run"),
        "{stderr}"
    );
    match t.db.submit(&spec).await {
        Err(DbError::InvalidSpec(msg)) => {
            assert!(msg.contains("is the id of another run"), "{msg}")
        }
        other => panic!("SQL submit returned {other:?}"),
    }
    // any other UUID is a key like any other
    let other = json!({"name": "c", "idempotency_key": uuid::Uuid::new_v4().to_string(), "steps": [step()]});
    let run = t.submit(other.clone()).await;
    assert_eq!(t.submit(other).await, run);
}

/// A cancel that waited its 10 s for a run row another transaction holds
/// says what happened and what to do (nothing was changed: end that
/// transaction, or try again), without a WARN line of sqlx above it.
#[tokio::test]
async fn a_cancel_blocked_by_a_held_run_says_what_to_do() {
    let t = TestDb::new().await;
    let run = t
        .submit(
            json!({"name": "held", "steps": [{"name": "a", "executor_kind": "go", "kind": "k"}]}),
        )
        .await;
    let holder = t.hold_run(run).await;
    let out = tokio::task::spawn_blocking({
        let url = t.url.clone();
        move || {
            Command::new(tests::supervisor_bin())
                .args(["cancel", &run.to_string()])
                .env("DATABASE_URL", url)
                .env_remove("RUST_LOG")
                .output()
                .expect("cancel")
        }
    })
    .await
    .expect("join");
    holder.rollback().await.expect("rollback");
    let msg = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{msg}");
    assert!(
        msg.contains("another transaction held the rows") && msg.contains("try again"),
        "{msg}"
    );
    assert!(!msg.contains("WARN"), "{msg}");
    let st = t.status(run).await;
    assert!(!st.cancel_requested, "nothing was changed");
}

/// A submit whose connection breaks before the database answers says that
/// the run may or may not exist and what to do, not only the driver's
/// error (chaos audit: "error communicating with database: expected to
/// read 5 bytes, got 0 bytes at EOF", with no word on the run). Here the
/// submit goes through a proxy, waits on a table lock, and the proxy closes
/// its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_cut_off_before_the_answer_says_the_run_may_exist() {
    let t = TestDb::new().await;
    let proxy = tests::blackhole::Blackhole::start(&t.url).await;
    let mut blocker = t.db.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durable.workflow_runs IN EXCLUSIVE MODE")
        .execute(&mut *blocker)
        .await
        .expect("lock");
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = dir.path().join("spec.json");
    std::fs::write(&spec, json!({"name": "cut", "steps": [step()]}).to_string()).expect("spec");
    let child = tokio::process::Command::new(tests::supervisor_bin())
        .args(["submit", &spec.to_string_lossy()])
        .env("DATABASE_URL", proxy.url(&t.url))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("submit");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE datname = current_database() AND wait_event_type = 'Lock')",
        )
        .fetch_one(t.db.pool())
        .await
        .expect("activity");
        if waiting {
            proxy.reset();
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the submit never waited on the lock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let out = child.wait_with_output().await.expect("wait");
    blocker.rollback().await.expect("rollback");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("the run may or may not have been created") && err.contains("idempotency_key"),
        "{err}"
    );
}

/// A key twice in one object of a spec is refused by `submit`, naming it:
/// JSON parsers and `jsonb` keep the last value without a word, so
/// `{"name": "a", …, "name": "b"}` created step `b` (DAG audit). (Through
/// SQL the spec is already `jsonb`: its duplicates are gone before
/// `durable.submit_run` sees it.)
#[tokio::test]
async fn a_key_given_twice_is_refused_by_submit() {
    let t = TestDb::new().await;
    let text = r#"{"name": "dup", "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "name": "b"}]}"#;
    let out = tests::submit_stdin(&t.url, text);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("duplicate key \"name\" at line 1 column"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty());
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        0
    );
    // the same key in two objects is no duplicate
    let ok = r#"{"name": "fine", "steps": [{"name": "a", "executor_kind": "go", "kind": "k", "input": {"name": 1}}]}"#;
    let out = tests::submit_stdin(&t.url, ok);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A known key with the very spec its run was made from returns the run,
/// even when today's checks would refuse that spec (made before a check
/// was tightened: upgrade audit, where a client's retried submit failed
/// after `migrate`); another spec with the key is still judged.
#[tokio::test]
async fn a_retried_submit_of_a_run_made_before_a_check_was_tightened_returns_it() {
    let t = TestDb::new().await;
    let made = json!({"name": "nightly", "idempotency_key": "nightly-1",
                      "steps": [{"name": "s", "executor_kind": "go", "kind": "k"}]});
    let run = t.submit(made).await;
    // as an older validator stored it: a code today's refuses
    let old = json!({"name": "nightly", "idempotency_key": "nightly-1",
                     "steps": [{"name": "s", "executor_kind": "go", "kind": "k",
                                "retry": {"non_retryable_codes": ["bad_input"]}}]});
    sqlx::query("UPDATE durable.workflow_runs SET spec = $2 WHERE id = $1")
        .bind(run)
        .bind(&old)
        .execute(t.db.pool())
        .await
        .expect("an older run's spec");
    assert_eq!(t.db.submit(&old).await.expect("the same spec again"), run);
    let out = tests::submit_stdin(&t.url, &old.to_string());
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // another spec with the key is judged as any
    let other = json!({"name": "nightly", "idempotency_key": "nightly-1",
                       "steps": [{"name": "s", "executor_kind": "go", "kind": "k",
                                  "retry": {"non_retryable_codes": ["other"]}}]});
    match t.db.submit(&other).await {
        Err(DbError::InvalidSpec(m)) => assert!(m.contains("is not an error code"), "{m}"),
        r => panic!("{r:?}"),
    }
}

/// A spec's input is read up to a bound and as UTF-8 with the offending
/// byte named: `submit /dev/zero` read until memory ran out, and a stray
/// byte said only "stream did not contain valid UTF-8" (operator's tools
/// audit). Both are exit 2, and nothing is written.
#[tokio::test]
async fn an_endless_or_binary_spec_is_refused_by_what_was_read() {
    let t = TestDb::new().await;
    let out = Command::new(tests::supervisor_bin())
        .args(["submit", "/dev/zero"])
        .env("DATABASE_URL", &t.url)
        .output()
        .expect("submit /dev/zero");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("/dev/zero is larger than 64 MiB; a spec is at most 16 MiB as stored"),
        "{stderr}"
    );
    let out = tests::submit_stdin(&t.url, "{\"name\": \"caf\u{e9}\"}");
    assert_eq!(
        out.status.code(),
        Some(2),
        "valid UTF-8 passes the read (and fails on its missing steps)"
    );
    let mut child = Command::new(tests::supervisor_bin())
        .args(["submit", "-"])
        .env("DATABASE_URL", &t.url)
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("submit -");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin.write_all(b"{\"name\": \"\xff\"}").expect("write");
    }
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("stdin is not UTF-8 text: the byte at offset 10 (0xff) is not valid UTF-8"),
        "{stderr}"
    );
    assert_eq!(
        t.scalar_i64("SELECT count(*) FROM durable.workflow_runs")
            .await,
        0
    );
}

/// A command whose output cannot be written (a full disk, `> /dev/full`)
/// fails with exit 1 and says so, instead of panicking (exit 101, a
/// backtrace); `submit` names the run it made, so that whoever retries does
/// not make it twice (operator's tools audit).
#[tokio::test]
async fn output_that_cannot_be_written_is_an_error_naming_the_submitted_run() {
    let t = TestDb::new().await;
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("/dev/full")
    };
    // a full disk, then a pipe nobody reads any more (a SIGPIPE ended the
    // latter silently after the run was made; re-check audit)
    let (read_end, write_end) = nix::unistd::pipe().expect("pipe");
    drop(read_end);
    for (name, stdout) in [
        ("full", std::process::Stdio::from(full())),
        ("piped", std::process::Stdio::from(write_end)),
    ] {
        let out = submit_to(&t.url, &json!({"name": name, "steps": [step()]}), stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        let id: uuid::Uuid =
            sqlx::query_scalar("SELECT id FROM durable.workflow_runs WHERE name = $1")
                .bind(name)
                .fetch_one(t.db.pool())
                .await
                .expect("the run was made");
        assert!(
            stderr.contains(&format!(
                "run {id} was submitted, but its id could not be written to standard output"
            )),
            "{name}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let out = Command::new(tests::supervisor_bin())
        .args(["runs"])
        .env("DATABASE_URL", &t.url)
        .stdout(full())
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("cannot write to standard output: No space left on device"),
        "{stderr}"
    );
}

/// `supervisor submit -` of `spec` with its stdout on `stdout`.
fn submit_to(url: &str, spec: &Value, stdout: std::process::Stdio) -> std::process::Output {
    use std::io::Write;
    let mut child = Command::new(tests::supervisor_bin())
        .args(["submit", "-"])
        .env("DATABASE_URL", url)
        .stdin(std::process::Stdio::piped())
        .stdout(stdout)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("submit");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(spec.to_string().as_bytes())
        .expect("write the spec");
    child.wait_with_output().expect("wait")
}

/// A `cancel` whose run (or named step) ends between the command's first
/// read and its cancel says nothing was cancelled: before, it worded its
/// answer from the stale read ("cancellation requested; run is succeeded",
/// outside audit 76 #1). The step's completion holds the run's row in a
/// transaction while the command reads; its cancel waits for that row and
/// finds the run (or step) ended.
#[tokio::test]
async fn cancel_of_a_run_that_ends_while_asked_says_nothing_was_cancelled() {
    for step_name in [None, Some("a")] {
        let t = TestDb::new().await;
        let (run, leased) = two_steps_leased(&t, 2).await;
        assert_eq!(leased.len(), 2);
        let by_name = |n: &str| {
            leased
                .iter()
                .find(|l| l.name == n)
                .expect("leased step")
                .lease
                .clone()
        };
        // a run cancel races the last step's end; a step cancel its step's
        let (first, last) = match step_name {
            None => (Some(by_name("a")), by_name("b")),
            Some(_) => (None, by_name("a")),
        };
        if let Some(first) = first {
            t.db.complete(&first, "w", &json!({}), &[], Some(2))
                .await
                .expect("complete a");
        }
        let mut tx = t.db.begin().await.expect("begin");
        tx.conn()
            .complete(&last, "w", &json!({}), &[], Some(2))
            .await
            .expect("complete inside the transaction");
        let mut args = vec!["cancel".to_string(), run.to_string()];
        if let Some(name) = step_name {
            args.extend(["--step".into(), name.into()]);
        }
        let cli = tokio::process::Command::new(tests::supervisor_bin())
            .args(&args)
            .env("DATABASE_URL", &t.url)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("cancel");
        // the command has read the run (running) and waits in cancel_run
        // for the run's row
        let until = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND query LIKE '%cancel_run%'",
            )
            .fetch_one(t.db.pool())
            .await
            .expect("pg_stat_activity");
            if n > 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < until,
                "the cancel never waited for the run's row"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        tx.commit().await.expect("commit");
        let out = cli.wait_with_output().await.expect("cancel output");
        let msg = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{msg}");
        let want = match step_name {
            None => format!("run {run} already succeeded; nothing to cancel"),
            Some(name) => {
                format!("step {name} already succeeded; nothing to cancel (run is running)")
            }
        };
        assert!(msg.contains(&want), "{step_name:?}: {msg}");
        assert!(!msg.contains("cancellation requested"), "{msg}");
        let st = t.status(run).await;
        assert!(!st.cancel_requested, "{step_name:?}");
    }
}
