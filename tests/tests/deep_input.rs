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
    assert!(e.message.contains("300 levels deep"), "{e:?}");
    // and the worker still runs steps
    let after = t
        .submit(tests::one_step("after", "go", "demo.echo", json!({"x": 1})))
        .await;
    let st = t.wait_terminal(after, Duration::from_secs(30)).await;
    assert_eq!(st.state, "succeeded");
    w.shutdown().await;
}
