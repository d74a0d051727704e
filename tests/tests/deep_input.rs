//! Input as deep as submit allows reaches its executor, and a stored input
//! the worker cannot decode fails its step; the worker never dies on a row.
//! `durable.submit_run` accepts input nested 128 levels, one more than
//! serde_json's default recursion limit takes: every worker that leased such
//! a step panicked decoding the row and exited, again at each lease, until
//! someone cancelled the run (an outside audit).

use std::time::Duration;

use serde_json::{json, Value};
use tests::{fast_config, go_demo, RunningWorker, TestDb};

/// `[[[…]]]`, `depth` arrays deep (built without a parser's recursion limit).
fn nested(depth: usize) -> Value {
    (0..depth - 1).fold(json!([]), |inner, _| Value::Array(vec![inner]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_input_runs_or_fails_its_step_and_the_worker_lives_on() {
    let t = TestDb::new().await;
    // as deep as submit allows: 128 levels
    let deep = t
        .submit(json!({"name": "deep", "steps": [
            {"name": "a", "executor_kind": "go", "kind": "demo.sleep",
             "input": {"ms": 1, "pad": nested(127)}}]}))
        .await;
    // deeper than the worker decodes: only a row stored before submit
    // checked depth, made here by hand
    let deeper = t
        .submit(tests::one_step("deeper", "go", "demo.echo", json!({})))
        .await;
    let text = format!("{}{}", "[".repeat(300), "]".repeat(300));
    sqlx::query("UPDATE durable.step_runs SET input = $2::jsonb WHERE run_id = $1")
        .bind(deeper)
        .bind(&text)
        .execute(t.db.pool())
        .await
        .expect("store a deeper input");

    let w = RunningWorker::start(
        t.connect(5).await,
        fast_config(vec![go_demo("go", &[], None)]),
    )
    .await;
    let st = t.wait_terminal(deep, Duration::from_secs(30)).await;
    assert_eq!(
        st.state,
        "succeeded",
        "{}",
        serde_json::to_string_pretty(&st).unwrap_or_default()
    );
    let st = t.wait_terminal(deeper, Duration::from_secs(30)).await;
    assert_eq!(st.state, "failed");
    let e = st.steps[0].error.as_ref().expect("error");
    assert_eq!(e.code, "INPUT_UNDECODABLE", "{e:?}");
    assert!(e.message.contains("nested 300 levels deep"), "{e:?}");
    // and the worker still runs steps
    let after = t
        .submit(tests::one_step("after", "go", "demo.echo", json!({"x": 1})))
        .await;
    let st = t.wait_terminal(after, Duration::from_secs(30)).await;
    assert_eq!(st.state, "succeeded");
    w.shutdown().await;
}

/// Input as deep as submit allows (128 levels), through `supervisor submit`
/// and SQL alike, comes back as its step's output from the Go and the Python
/// executor. The CLI refused it past 124 levels (serde_json's limit counted
/// the spec around it), and the worker refused the echoed output at 128
/// (OUTPUT_INVALID, "recursion limit exceeded"): a valid spec failed its step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_as_deep_as_allowed_round_trips_through_both_executors() {
    let t = TestDb::new().await;
    let deepest = nested(128);
    let mut runs = Vec::new();
    for ex in ["go", "python"] {
        let spec = json!({"name": format!("deep-{ex}"), "steps": [
            {"name": "a", "executor_kind": ex, "kind": "demo.echo", "input": deepest}]});
        let out = tests::submit_stdin(&t.url, &spec.to_string());
        assert_eq!(
            out.status.code(),
            Some(0),
            "{ex}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let id: serde_json::Value = serde_json::from_slice(&out.stdout).expect("run id json");
        let id = id["run_id"]
            .as_str()
            .expect("run_id")
            .parse()
            .expect("uuid");
        runs.push((ex, id, deepest.clone()));
    }
    // one more level is refused by the CLI (exit 2), naming the limit
    let spec = json!({"name": "deeper", "steps": [
        {"name": "a", "executor_kind": "go", "kind": "demo.echo", "input": nested(129)}]});
    let out = tests::submit_stdin(&t.url, &spec.to_string());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("an input nests at most 128 levels"), "{err}");

    let w = RunningWorker::start(
        t.connect(5).await,
        fast_config(vec![
            go_demo("go", &[], None),
            tests::python_demo("python", &[], None),
        ]),
    )
    .await;
    for (ex, run, input) in runs {
        let st = t.wait_terminal(run, Duration::from_secs(60)).await;
        assert_eq!(
            st.state,
            "succeeded",
            "{ex}: {}",
            serde_json::to_string_pretty(&st).unwrap_or_default()
        );
        let output: String =
            sqlx::query_scalar("SELECT output::text FROM durable.step_runs WHERE run_id = $1")
                .bind(run)
                .fetch_one(t.db.pool())
                .await
                .expect("output");
        assert_eq!(
            supervisor::json::depth(output.as_bytes()),
            128,
            "{ex}: the output is the input, 128 levels deep"
        );
        assert_eq!(output.replace(' ', ""), input.to_string(), "{ex}");
    }
    w.shutdown().await;
}
