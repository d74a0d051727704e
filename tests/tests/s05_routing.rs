//! S05: routing by executor_kind, kind and labels. One worker with two Go
//! executors and one Python executor offering different kinds and labels runs
//! every compatible step on a matching executor and never leases an
//! incompatible one; the routing check agrees with the same model; and an
//! executor whose hello at spawn no longer offers the step's kind refuses it
//! before execution (EXECUTOR_REFUSED, attempt given back), after which a
//! compatible worker runs it.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use supervisor::config::ExecutorConfig;
use supervisor::wire::{Hello, PROTOCOL_VERSION};
use supervisor::worker::routing;
use tests::{
    event_count, executor_pid, fast_config, go_demo, python_demo, step_transitions, wrap_in_shell,
    RunningWorker, TestDb,
};
use uuid::Uuid;

const LONG: Duration = Duration::from_secs(120);

/// What one executor offers: (name, executor_kind, kinds, labels).
struct Offer {
    name: &'static str,
    executor_kind: &'static str,
    kinds: &'static [&'static str],
    labels: &'static [(&'static str, &'static str)],
}

const OFFERS: [Offer; 3] = [
    Offer {
        name: "go-a",
        executor_kind: "go",
        kinds: &["demo.echo", "demo.sleep"],
        labels: &[("zone", "a")],
    },
    Offer {
        name: "go-b",
        executor_kind: "go",
        kinds: &["demo.echo"],
        labels: &[("zone", "b"), ("gpu", "true")],
    },
    Offer {
        name: "py",
        executor_kind: "python",
        kinds: &["demo.echo", "demo.artifact"],
        labels: &[("zone", "a")],
    },
];

const EXECUTOR_KINDS: [&str; 3] = ["go", "python", "rust"];
const KINDS: [&str; 3] = ["demo.echo", "demo.sleep", "demo.artifact"];
const LABELS: [&[(&str, &str)]; 4] = [
    &[],
    &[("zone", "a")],
    &[("zone", "b"), ("gpu", "true")],
    &[("zone", "c")],
];

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn show_labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}:{v}")).collect();
    format!("{{{}}}", inner.join(","))
}

/// The model: the executors that may run a step.
fn matching(executor_kind: &str, kind: &str, step_labels: &[(&str, &str)]) -> Vec<&'static str> {
    OFFERS
        .iter()
        .filter(|o| {
            o.executor_kind == executor_kind
                && o.kinds.contains(&kind)
                && step_labels.iter().all(|l| o.labels.contains(l))
        })
        .map(|o| o.name)
        .collect()
}

fn input_for(kind: &str) -> Value {
    match kind {
        "demo.sleep" => json!({"ms": 50, "steps": 2}),
        "demo.artifact" => json!({"name": "a.txt", "content": "routed"}),
        _ => json!({"hello": "routing"}),
    }
}

/// The executor config of an offer, started through a shell that records
/// "<pid> <name>" before exec'ing it (the pid stays the executor's).
fn offer_config(o: &Offer, pid_log: &std::path::Path) -> ExecutorConfig {
    let base = match o.executor_kind {
        "go" => go_demo(o.name, o.labels, Some(o.kinds)),
        _ => python_demo(o.name, o.labels, Some(o.kinds)),
    };
    wrap_in_shell(
        base,
        &format!(
            "echo \"$$ {}\" >> '{}'; exec \"$0\" \"$@\"",
            o.name,
            pid_log.display()
        ),
    )
}

fn pid_names(pid_log: &std::path::Path) -> HashMap<i32, String> {
    std::fs::read_to_string(pid_log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let (pid, name) = l.split_once(' ')?;
            Some((pid.parse().ok()?, name.to_string()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_combination_runs_on_a_matching_executor_or_never() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let pid_log = dir.path().join("pids");
    let cfg = fast_config(OFFERS.iter().map(|o| offer_config(o, &pid_log)).collect());
    let w = RunningWorker::start(t.connect(8).await, cfg).await;

    struct Case {
        executor_kind: &'static str,
        kind: &'static str,
        labels: &'static [(&'static str, &'static str)],
        expected: Vec<&'static str>,
        run: Uuid,
    }
    let mut cases = Vec::new();
    for ek in EXECUTOR_KINDS {
        for kind in KINDS {
            for l in LABELS {
                let run = t
                    .submit(
                        json!({"name": format!("route {ek} {kind} {}", show_labels(l)),
                        "steps": [{"name": "s", "executor_kind": ek, "kind": kind,
                                   "input": input_for(kind), "labels": labels(l)}]}),
                    )
                    .await;
                cases.push(Case {
                    executor_kind: ek,
                    kind,
                    labels: l,
                    expected: matching(ek, kind, l),
                    run,
                });
            }
        }
    }
    let accepted = cases.iter().filter(|c| !c.expected.is_empty()).count();
    assert_eq!(
        accepted, 9,
        "the model: 9 of 36 combinations have a matching executor"
    );

    // every compatible step completes
    for c in cases.iter().filter(|c| !c.expected.is_empty()) {
        let st = t.wait_terminal(c.run, LONG).await;
        assert_eq!(
            st.state,
            "succeeded",
            "{} {} {}: {:?}",
            c.executor_kind,
            c.kind,
            show_labels(c.labels),
            st.steps[0].error
        );
    }
    // give the worker time to (wrongly) take any of the others: many lease polls
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let names = pid_names(&pid_log);
    let mut table = vec![format!(
        "{:<8} {:<14} {:<20} {:<8} {:<11} {:<8} {}",
        "exec", "kind", "labels", "expect", "state", "ran on", "matching executors"
    )];
    for c in &cases {
        let st = t.status(c.run).await;
        let s = &st.steps[0];
        let history = step_transitions(&t.db, s.step_run_id).await;
        let ran_on = match executor_pid(&t.db, s.step_run_id).await {
            Some(pid) => names
                .get(&pid)
                .cloned()
                .unwrap_or_else(|| format!("pid {pid}?")),
            None => "-".into(),
        };
        let what = format!("{} {} {}", c.executor_kind, c.kind, show_labels(c.labels));
        if c.expected.is_empty() {
            assert_eq!(s.state, "pending", "{what}: never leased");
            assert_eq!(s.attempt, 0, "{what}: no attempt");
            assert_eq!(
                history
                    .iter()
                    .map(|h| h.to_state.as_str())
                    .collect::<Vec<_>>(),
                vec!["pending"],
                "{what}: no transition after submit"
            );
            assert_eq!(event_count(&t.db, s.step_run_id).await, 0, "{what}");
            assert_eq!(ran_on, "-", "{what}");
        } else {
            assert_eq!(s.state, "succeeded", "{what}");
            assert_eq!(s.attempt, 1, "{what}: no refusal, no retry");
            assert!(
                c.expected.contains(&ran_on.as_str()),
                "{what} ran on {ran_on}, expected one of {:?}",
                c.expected
            );
            assert_eq!(
                history.iter().filter(|h| h.to_state == "running").count(),
                1,
                "{what}"
            );
            if c.kind == "demo.echo" {
                assert_eq!(s.output, Some(input_for(c.kind)), "{what}");
            }
        }
        table.push(format!(
            "{:<8} {:<14} {:<20} {:<8} {:<11} {:<8} {}",
            c.executor_kind,
            c.kind,
            show_labels(c.labels),
            if c.expected.is_empty() {
                "refuse"
            } else {
                "accept"
            },
            s.state,
            ran_on,
            if c.expected.is_empty() {
                "-".to_string()
            } else {
                c.expected.join(",")
            }
        ));
    }
    println!("S05 routing matrix (executors: go-a go{{echo,sleep}} zone=a; go-b go{{echo}} zone=b,gpu=true; py python{{echo,artifact}} zone=a)\n{}", table.join("\n"));
    w.shutdown().await;
}

fn hello(o: &Offer) -> Hello {
    Hello {
        protocol_version: PROTOCOL_VERSION,
        executor_kind: o.executor_kind.into(),
        kinds: o.kinds.iter().map(|k| k.to_string()).collect(),
        labels: labels(o.labels),
        sdk_name: "test".into(),
        sdk_version: "0".into(),
        max_jobs_per_process: 1,
        pid: 1,
        protocol_versions: Vec::new(),
        features: Vec::new(),
        max_frame_bytes: 0,
    }
}

/// The check a freshly spawned executor's hello goes through agrees with the
/// model on every (executor, step) pair, and the lease routes built from a
/// hello cover exactly the accepted pairs.
#[test]
fn the_routing_check_agrees_with_the_model() {
    let mut refusals = Vec::new();
    for o in &OFFERS {
        let h = hello(o);
        let cfg = ExecutorConfig {
            name: o.name.into(),
            command: "unused".into(),
            ..ExecutorConfig::default()
        };
        let routes = routing::routes(&h, &cfg);
        for ek in EXECUTOR_KINDS {
            for kind in KINDS {
                for l in LABELS {
                    let model = matching(ek, kind, l).contains(&o.name);
                    let checked = routing::check(&h, &cfg, ek, kind, &labels(l));
                    assert_eq!(
                        checked.is_ok(),
                        model,
                        "{} for {ek} {kind} {}: {checked:?}",
                        o.name,
                        show_labels(l)
                    );
                    // the lease query's rule: same executor_kind and kind, route labels ⊇ step labels
                    let routed = routes.iter().any(|r| {
                        r.executor_kind == ek
                            && r.kind == kind
                            && labels(l).iter().all(|(k, v)| r.labels.get(k) == Some(v))
                    });
                    assert_eq!(routed, model, "{} routes for {ek} {kind}", o.name);
                    if let Err(why) = checked {
                        if ek == o.executor_kind && l.len() < 2 {
                            refusals.push(format!(
                                "{:<5} {ek} {kind} {}: {why}",
                                o.name,
                                show_labels(l)
                            ));
                        }
                    }
                }
            }
        }
    }
    // host labels from the worker config add to the hello's, and win on conflict
    let h = hello(&OFFERS[0]);
    let mut cfg = ExecutorConfig {
        name: "go-a".into(),
        command: "unused".into(),
        ..ExecutorConfig::default()
    };
    cfg.labels = labels(&[("zone", "z"), ("ssd", "yes")]);
    assert!(routing::check(
        &h,
        &cfg,
        "go",
        "demo.echo",
        &labels(&[("zone", "z"), ("ssd", "yes")])
    )
    .is_ok());
    assert!(routing::check(&h, &cfg, "go", "demo.echo", &labels(&[("zone", "a")])).is_err());
    // the config may narrow the kinds, never widen them
    cfg.kinds = Some(vec!["demo.sleep".into(), "demo.artifact".into()]);
    assert!(routing::check(&h, &cfg, "go", "demo.sleep", &labels(&[])).is_ok());
    assert!(routing::check(&h, &cfg, "go", "demo.echo", &labels(&[])).is_err());
    assert!(routing::check(&h, &cfg, "go", "demo.artifact", &labels(&[])).is_err());
    assert_eq!(routing::routes(&h, &cfg).len(), 1);
    // a hello of another protocol version is refused whatever it offers
    let mut old = hello(&OFFERS[0]);
    old.protocol_version = PROTOCOL_VERSION + 1;
    assert!(routing::check(
        &old,
        &ExecutorConfig::default(),
        "go",
        "demo.echo",
        &labels(&[])
    )
    .is_err());
    println!("some refusal reasons:\n{}", refusals.join("\n"));
}

/// The executor's hello at probe time offers demo.sleep, at spawn time no
/// longer: the worker leases the step, then refuses it before sending any job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hello_that_no_longer_fits_is_refused_before_execution() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let mark = dir.path().join("probed");
    let fickle = wrap_in_shell(
        go_demo("fickle", &[], None),
        &format!(
            "if [ -e '{m}' ]; then DEMO_KINDS=demo.echo; else : > '{m}'; DEMO_KINDS=demo.echo,demo.sleep; fi; \
             export DEMO_KINDS; exec \"$0\" \"$@\"",
            m = mark.display()
        ),
    );
    let mut cfg = fast_config(vec![fickle]);
    cfg.name = Some("refuser".into());
    cfg.refusal_delay_ms = 1_000;
    let refuser = RunningWorker::start(t.connect(5).await, cfg).await;
    assert!(mark.exists(), "the probe ran the wrapper once");

    let run = t
        .submit(
            json!({"name": "fickle", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.sleep", "input": {"ms": 200, "steps": 2},
            "retry": {"max_attempts": 1}}]}),
        )
        .await;
    // refused: back in the queue, the attempt given back
    let st = t
        .wait_run(run, LONG, |s| {
            s.steps.first().is_some_and(|st| {
                st.state == "retryable_failed"
                    && st
                        .error
                        .as_ref()
                        .is_some_and(|e| e.code == "EXECUTOR_REFUSED")
            })
        })
        .await;
    let s = &st.steps[0];
    let step = s.step_run_id;
    assert_eq!(s.attempt, 0, "a refusal consumes no attempt");
    let msg = &s.error.as_ref().expect("error").message;
    assert!(
        msg.contains("demo.sleep"),
        "the reason names the kind: {msg}"
    );
    let history = step_transitions(&t.db, step).await;
    let refusal = history
        .iter()
        .find(|h| h.to_state == "retryable_failed")
        .expect("refusal recorded");
    assert_eq!(refusal.from_state.as_deref(), Some("leased"));
    assert_eq!(refusal.reason.as_deref(), Some("EXECUTOR_REFUSED"));
    assert_eq!(refusal.worker.as_deref(), Some("refuser"));
    assert!(
        history.iter().all(|h| h.to_state != "running"),
        "{history:?}"
    );
    assert_eq!(event_count(&t.db, step).await, 0, "no job was executed");
    assert_eq!(executor_pid(&t.db, step).await, None);

    // a compatible worker takes it (the refuser keeps competing and refusing)
    let mut cfg = fast_config(vec![go_demo("go", &[], None)]);
    cfg.name = Some("compatible".into());
    let good = RunningWorker::start(t.connect(5).await, cfg).await;
    let st = t.wait_terminal(run, LONG).await;
    assert_eq!(st.state, "succeeded", "{:?}", st.steps[0].error);
    assert_eq!(
        st.steps[0].attempt, 1,
        "max_attempts 1 was enough: refusals are free"
    );
    let history = step_transitions(&t.db, step).await;
    let ran: Vec<(Option<&str>, &str)> = history
        .iter()
        .filter(|h| h.to_state == "running" || h.to_state == "succeeded")
        .map(|h| (h.worker.as_deref(), h.to_state.as_str()))
        .collect();
    assert_eq!(
        ran,
        vec![
            (Some("compatible"), "running"),
            (Some("compatible"), "succeeded")
        ]
    );
    let refusals = history
        .iter()
        .filter(|h| h.reason.as_deref() == Some("EXECUTOR_REFUSED"))
        .count();
    println!("refused {refusals} time(s) by `refuser`, then run by `compatible`");
    tests::assert_no_survivors(step, None, Duration::from_secs(5)).await;
    good.shutdown().await;
    refuser.shutdown().await;
}

/// Two secrets directories: one without ROUTE_TOKEN, one with it.
fn secret_dirs() -> (tempfile::TempDir, tempfile::TempDir) {
    let (without, with) = (
        tempfile::tempdir().expect("tempdir"),
        tempfile::tempdir().expect("tempdir"),
    );
    std::fs::write(with.path().join("ROUTE_TOKEN"), "route-token-123456\n").expect("secret");
    (without, with)
}

/// A run of `n` echo steps, every other one naming the secret ROUTE_TOKEN.
fn every_other_names_the_token(n: usize) -> Value {
    let steps: Vec<Value> = (0..n)
        .map(|i| {
            let mut s = json!({"name": format!("s{i}"), "executor_kind": "go",
                               "kind": "demo.echo", "input": {"i": i}});
            if i % 2 == 0 {
                s["secrets"] = json!(["ROUTE_TOKEN"]);
            }
            s
        })
        .collect();
    json!({"name": "secret", "steps": steps})
}

/// A worker named `name` with the Go demo allowed the secret ROUTE_TOKEN,
/// read from `dir` (where it may be missing).
fn route_token_worker(name: &str, dir: &std::path::Path) -> supervisor::config::WorkerConfig {
    let mut e = go_demo("go", &[], None);
    e.secrets = vec!["ROUTE_TOKEN".into()];
    let mut cfg = fast_config(vec![e]);
    cfg.name = Some(name.into());
    cfg.secrets_dir = Some(dir.to_owned());
    cfg
}

/// Steps that need a secret one worker lacks and another has all run on
/// the one that has it (routing audit): the worker without it refused each
/// (SECRET_UNAVAILABLE, "so another worker can run the step"), then leased
/// it again as soon as it was due, ahead of the other, until its refusals
/// failed the step (REFUSALS_EXHAUSTED) while the worker with the secret
/// idled. A refused step is now left to other workers for a while.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steps_refused_for_a_missing_secret_run_on_the_worker_that_has_it() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (without, with) = secret_dirs();
    let config = |name: &str, dir: &std::path::Path| {
        let mut cfg = route_token_worker(name, dir);
        cfg.executors[0].concurrency = 1;
        cfg
    };
    let lacks = RunningWorker::start(t.connect(10).await, config("lacks", without.path())).await;
    let has = RunningWorker::start(t.connect(10).await, config("has", with.path())).await;
    let steps: Vec<Value> = (0..10)
        .map(|i| {
            json!({"name": format!("s{i}"), "executor_kind": "go", "kind": "demo.echo",
                   "input": {"i": i}, "secrets": ["ROUTE_TOKEN"]})
        })
        .collect();
    let run = t.submit(json!({"name": "secret", "steps": steps})).await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    lacks.shutdown().await;
    has.shutdown().await;
    for s in &st.steps {
        assert_eq!(s.state, "succeeded", "{}: {:?}", s.name, s.error);
    }
    assert_eq!(st.state, "succeeded");
}

/// A step refused by one worker is leased by another as soon as the
/// refusal's delay ends (time audit): the other worker was woken when the
/// step was refused, found it not yet due, and waited for its next poll,
/// while the refusing worker leased it again and refused it once more.
/// Here the worker with the secret polls every 30 s; the refusing worker
/// announces the step when its 3 s delay ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_step_is_announced_to_the_other_workers_when_it_comes_due() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (without, with) = secret_dirs();
    let mut lacks_cfg = route_token_worker("lacks", without.path());
    lacks_cfg.refusal_delay_ms = 3_000;
    let lacks = RunningWorker::start(t.connect(10).await, lacks_cfg).await;
    let run = t
        .submit(json!({"name": "secret", "steps": [
            {"name": "s", "executor_kind": "go", "kind": "demo.echo", "input": {},
             "secrets": ["ROUTE_TOKEN"]}]}))
        .await;
    let id = tests::only_step_id(&t, run).await;
    let until = Instant::now() + Duration::from_secs(30);
    while t
        .scalar_i64(&format!(
            "SELECT refusals::int8 FROM durable.step_runs WHERE id = '{id}'"
        ))
        .await
        == 0
    {
        assert!(Instant::now() < until, "the step was never refused");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // the refusal's delay has ~3 s to go: the worker with the secret starts
    // now, finds nothing due, and would look again only in 30 s
    let mut has_cfg = route_token_worker("has", with.path());
    has_cfg.poll_interval_ms = 30_000;
    let has = RunningWorker::start(t.connect(10).await, has_cfg).await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    lacks.shutdown().await;
    has.shutdown().await;
    let s = tests::step(&st, "s");
    assert_eq!(s.state, "succeeded", "{:?}", s.error);
    let (refusals, by): (i32, Option<String>) = sqlx::query_as(
        "SELECT s.refusals, (SELECT worker FROM durable.transitions
                              WHERE step_run_id = s.id AND to_state = 'leased' ORDER BY id DESC LIMIT 1)
           FROM durable.step_runs s WHERE s.id = $1",
    )
    .bind(id)
    .fetch_one(t.db.pool())
    .await
    .expect("the step");
    assert_eq!(
        (refusals, by.as_deref()),
        (1, Some("has")),
        "the worker with the secret leased the step once it came due"
    );
}

/// In one worker, two executors serve the same kind and only one may hand
/// out ROUTE_TOKEN: every step naming it runs on that one, every step
/// naming nothing runs on either, and a step naming a secret neither may
/// hand out still fails SECRET_NOT_ALLOWED. Before, whichever executor
/// leased first took a step, and the one without the secret failed it for
/// good (and its run with it: security audit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_naming_a_secret_runs_on_the_executor_that_may_hand_it_out() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (_without, with) = secret_dirs();
    let mut cfg = route_token_worker("two-executors", with.path());
    let mut plain = go_demo("go-plain", &[], None);
    plain.concurrency = 4;
    cfg.executors[0].concurrency = 2;
    cfg.executors.push(plain);
    let w = RunningWorker::start(t.connect(12).await, cfg).await;
    let run = t.submit(every_other_names_the_token(12)).await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    for s in &st.steps {
        assert_eq!(s.state, "succeeded", "{}: {:?}", s.name, s.error);
    }
    let run = t
        .submit(
            json!({"name": "neither", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.echo", "input": {}, "secrets": ["OTHER_TOKEN"]}]}),
        )
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    w.shutdown().await;
    let s = tests::step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("SECRET_NOT_ALLOWED")
    );
}

/// Across workers: a step naming a secret that one worker's executor may
/// not hand out is left to a live worker whose executor may (routing audit:
/// the worker without it leased the steps first and failed each
/// SECRET_NOT_ALLOWED, and the run with them, while the other idled). Once
/// no live worker may run such a step, it still fails SECRET_NOT_ALLOWED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_naming_a_secret_is_left_to_the_worker_that_may_hand_it_out() {
    let _serial = tests::exclusive().await;
    let t = TestDb::new().await;
    let (_without, with) = secret_dirs();
    let mut plain_cfg = fast_config(vec![go_demo("go-plain", &[], None)]);
    plain_cfg.name = Some("plain".into());
    plain_cfg.executors[0].concurrency = 4;
    let plain = RunningWorker::start(t.connect(10).await, plain_cfg).await;
    let mut holder_cfg = route_token_worker("holder", with.path());
    holder_cfg.executors[0].concurrency = 1;
    let holder = RunningWorker::start(t.connect(10).await, holder_cfg).await;
    let run = t.submit(every_other_names_the_token(8)).await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    for s in &st.steps {
        assert_eq!(s.state, "succeeded", "{}: {:?}", s.name, s.error);
    }
    let by: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT s.name, (SELECT worker FROM durable.transitions
                          WHERE step_run_id = s.id AND to_state = 'leased' ORDER BY id DESC LIMIT 1)
           FROM durable.step_runs s WHERE s.run_id = $1 AND cardinality(s.secrets) > 0",
    )
    .bind(run)
    .fetch_all(t.db.pool())
    .await
    .expect("steps");
    assert_eq!(by.len(), 4);
    for (name, worker) in &by {
        assert_eq!(worker.as_deref(), Some("holder"), "{name}: {by:?}");
    }
    // the worker that may hand it out stops: no live worker may, and the
    // step fails as it does when no executor may
    holder.shutdown().await;
    let run = t
        .submit(
            json!({"name": "alone", "steps": [{"name": "s", "executor_kind": "go",
            "kind": "demo.echo", "input": {}, "secrets": ["ROUTE_TOKEN"]}]}),
        )
        .await;
    let st = t.wait_terminal(run, Duration::from_secs(60)).await;
    plain.shutdown().await;
    let s = tests::step(&st, "s");
    assert_eq!(s.state, "terminal_failed");
    assert_eq!(
        s.error.as_ref().map(|e| e.code.as_str()),
        Some("SECRET_NOT_ALLOWED")
    );
}
