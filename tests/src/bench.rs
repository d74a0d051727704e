//! Helpers shared by the benchmark binaries (tests/src/bin): CPU and machine
//! readings, percentiles, tables, and the setup header every benchmark prints.

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use serde_json::{json, Value};
use supervisor::db::Db;

pub use crate::db_url;

/// A pool of `n` connections for a plain-SQL baseline: PostgreSQL's own plan
/// cache (the runtime's connections plan every statement generically, which
/// its SQL is written for and the baselines' statements are not), JIT off and
/// the statement timeout as on the runtime's.
pub async fn plain_db(url: &str, n: u32) -> Result<Db> {
    let opts: sqlx::postgres::PgConnectOptions = url.parse()?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(n)
        .test_before_acquire(false)
        .connect_with(opts.options([("statement_timeout", "60000"), ("jit", "off")]))
        .await?;
    Ok(Db::from_pool(pool))
}

pub fn busy_fraction(a: (u64, u64), b: (u64, u64)) -> f64 {
    let total = b.1.saturating_sub(a.1);
    if total == 0 {
        0.0
    } else {
        b.0.saturating_sub(a.0) as f64 / total as f64
    }
}

pub fn clk_tck() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// host[:port] of a database URL (no credentials).
pub fn db_host(url: &str) -> String {
    let rest = url.split_once("://").map(|(_, r)| r).unwrap_or(url);
    let rest = rest.rsplit_once('@').map(|(_, r)| r).unwrap_or(rest);
    rest.split(['/', '?']).next().unwrap_or("").to_string()
}

pub async fn drop_databases(admin: &str, names: &[String]) {
    if names.is_empty() {
        return;
    }
    match Db::connect(admin, 1).await {
        Ok(db) => {
            for n in names {
                if let Err(e) = sqlx::query(&format!("DROP DATABASE IF EXISTS {n} WITH (FORCE)"))
                    .execute(db.pool())
                    .await
                {
                    eprintln!("could not drop database {n}: {e}");
                }
            }
            db.pool().close().await;
        }
        Err(e) => eprintln!("could not connect to drop {names:?}: {e}"),
    }
}

pub fn fmt_ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 10.0 {
        format!("{ms:.2}")
    } else if ms < 100.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.0}")
    }
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "n/a".into())
}

/// (busy, total) jiffies of all CPUs.
pub fn machine_cpu() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/stat").ok()?;
    let line = s.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0);
    Some((total - idle, total))
}

/// Nearest-rank percentile.
pub fn pct(v: &[Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// Machine, PostgreSQL and build facts, as the JSON summary's `setup`.
pub async fn setup_json(admin: &Db, url: &str) -> Result<Value> {
    let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let nproc = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0 / 1024.0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(admin.pool())
        .await?;
    let settings = show(
        admin,
        &[
            "fsync",
            "synchronous_commit",
            "full_page_writes",
            "shared_buffers",
            "max_connections",
            "autovacuum",
            "work_mem",
            "shared_preload_libraries",
        ],
    )
    .await?;
    // what Db::connect sets on the runtime's own connections (admin is one)
    let session = show(admin, &["plan_cache_mode", "jit"]).await?;
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(env!("CARGO_MANIFEST_DIR"))
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
    };
    let commit = git(&["rev-parse", "--short", "HEAD"])
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = git(&["status", "--porcelain", "--untracked-files=no"])
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    // where the worker's job directories go (its default work_dir: the temp
    // dir, TMPDIR), and on what: on ext4 without a journal each one made and
    // removed slows the next (supervisor::hostfs)
    let work_dir = std::env::temp_dir();
    let work_fs = supervisor::hostfs::Filesystem::of(&work_dir)
        .map(|f| f.describe())
        .unwrap_or_else(|| "unknown".into());
    Ok(json!({
        "cpu_model": cpu_model,
        "cores": nproc,
        "memory_gib": mem_gib,
        "kernel": kernel,
        "load_average": loadavg(),
        "postgresql_version": version,
        "postgresql_settings": settings,
        "runtime_session_settings": session,
        "postgresql_host": db_host(url),
        "build_profile": if cfg!(debug_assertions) { "debug" } else { "release" },
        "git_commit": commit,
        "git_dirty": dirty,
        "work_dir": work_dir.display().to_string(),
        "work_dir_filesystem": work_fs,
    }))
}

/// These settings of `admin`'s session, by name.
async fn show(admin: &Db, names: &[&str]) -> Result<serde_json::Map<String, Value>> {
    let mut out = serde_json::Map::new();
    for s in names {
        let v: String = sqlx::query_scalar(&format!("SHOW {s}"))
            .fetch_one(admin.pool())
            .await?;
        out.insert((*s).into(), Value::String(v));
    }
    Ok(out)
}

/// `k=v, k=v` of a JSON object of strings.
fn key_values(v: &Value) -> String {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// Prints machine, PostgreSQL and build facts (from [`setup_json`]) and returns them.
pub async fn print_setup(admin: &Db, url: &str) -> Result<Value> {
    let s = setup_json(admin, url).await?;
    let st = |k: &str| s[k].as_str().unwrap_or("").to_string();
    println!(
        "machine     : {}; nproc {}; memory {}; Linux {}; load average {}",
        st("cpu_model"),
        s["cores"],
        s["memory_gib"]
            .as_f64()
            .map(|g| format!("{g:.1} GiB"))
            .unwrap_or_else(|| "unknown".into()),
        st("kernel"),
        st("load_average"),
    );
    let settings = key_values(&s["postgresql_settings"]);
    println!("postgresql  : {}; {settings}", st("postgresql_version"));
    let session = key_values(&s["runtime_session_settings"]);
    println!(
        "sessions    : the runtime's connections {session}; plain-SQL baselines PostgreSQL's plan cache (plan_cache_mode=auto), jit=off"
    );
    println!(
        "build       : {} profile (debug_assertions {}); git {}{}; database server at {}",
        st("build_profile"),
        if cfg!(debug_assertions) { "on" } else { "off" },
        st("git_commit"),
        if s["git_dirty"].as_bool() == Some(true) {
            " + uncommitted changes"
        } else {
            ""
        },
        st("postgresql_host"),
    );
    println!(
        "work_dir    : {} on {} (the worker's default, the temp dir: set TMPDIR to move it)",
        st("work_dir"),
        st("work_dir_filesystem"),
    );
    Ok(s)
}

/// Which side of its limit a target's measured value must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    AtLeast,
    AtMost,
}

/// What one benchmark binary measured, for the JSON summary: its setup and
/// parameters, every figure it printed (with the setup of that figure), and
/// each of issue 7's targets it can judge, with the measured value and
/// met/missed. `scripts/bench` merges the parts (bench_summary).
pub struct Report {
    bench: String,
    setup: Value,
    params: Value,
    figures: Vec<Value>,
    targets: Vec<Value>,
}

impl Report {
    pub fn new(bench: &str) -> Report {
        Report {
            bench: bench.into(),
            setup: Value::Null,
            params: Value::Null,
            figures: Vec::new(),
            targets: Vec::new(),
        }
    }

    pub fn set_setup(&mut self, setup: Value) {
        self.setup = setup;
    }

    pub fn set_params(&mut self, params: Value) {
        self.params = params;
    }

    /// One printed figure: `name` (e.g. "lease p50"), its value and unit, and
    /// the conditions it was measured under (executor, concurrency, sizes …).
    pub fn figure(&mut self, name: &str, value: f64, unit: &str, setup: Value) {
        self.figures.push(json!({
            "name": name,
            "value": finite(value),
            "unit": unit,
            "setup": setup,
        }));
    }

    /// One target of the issue: `id` (e.g. "a.persistent_go_steps_per_s"),
    /// what it says, the measured value, the limit and its direction.
    #[allow(clippy::too_many_arguments)] // one call per target reads best flat
    pub fn target(
        &mut self,
        id: &str,
        description: &str,
        measured: f64,
        want: Want,
        limit: f64,
        unit: &str,
        setup: Value,
    ) {
        let met = measured.is_finite()
            && match want {
                Want::AtLeast => measured >= limit,
                Want::AtMost => measured <= limit,
            };
        self.targets.push(json!({
            "id": id,
            "description": description,
            "measured": finite(measured),
            "limit": limit,
            "want": match want { Want::AtLeast => ">=", Want::AtMost => "<=" },
            "unit": unit,
            "met": met,
            "setup": setup,
        }));
    }

    pub fn to_json(&self) -> Value {
        json!({
            "bench": self.bench,
            "setup": self.setup,
            "params": self.params,
            "figures": self.figures,
            "targets": self.targets,
        })
    }

    /// Prints the targets as a table (if any).
    pub fn print_targets(&self) {
        print_targets(&self.targets);
    }

    /// Writes the part to `path` (creating its directory), if given.
    pub fn write(&self, path: Option<&Path>) -> Result<()> {
        let Some(path) = path else { return Ok(()) };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(path, serde_json::to_string_pretty(&self.to_json())?)?;
        eprintln!("({}: JSON written to {})", self.bench, path.display());
        Ok(())
    }
}

fn finite(v: f64) -> Value {
    if v.is_finite() {
        json!(v)
    } else {
        Value::Null
    }
}

/// Prints targets (JSON objects as [`Report::target`] makes them) as a table.
pub fn print_targets(targets: &[Value]) {
    if targets.is_empty() {
        return;
    }
    println!("-- targets (issue 7)");
    let rows: Vec<Vec<String>> = targets
        .iter()
        .map(|t| {
            vec![
                t["id"].as_str().unwrap_or("").to_string(),
                t["description"].as_str().unwrap_or("").to_string(),
                t["measured"]
                    .as_f64()
                    .map(fmt_num)
                    .unwrap_or_else(|| "n/a".into()),
                format!(
                    "{} {}",
                    t["want"].as_str().unwrap_or(""),
                    t["limit"].as_f64().map(fmt_num).unwrap_or_default()
                ),
                t["unit"].as_str().unwrap_or("").to_string(),
                if t["met"].as_bool() == Some(true) {
                    "met".into()
                } else {
                    "MISSED".into()
                },
            ]
        })
        .collect();
    print_table(
        &["target", "what", "measured", "limit", "unit", "result"],
        2,
        &rows,
    );
}

/// A number with a precision that fits its size.
pub fn fmt_num(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        format!("{v:.0}")
    } else if a >= 100.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// Prints a table; the first `left` columns are left-aligned.
pub fn print_table(headers: &[&str], left: usize, rows: &[Vec<String>]) {
    let mut w: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = w[i] - c.chars().count();
                if i < left {
                    format!("{c}{}", " ".repeat(pad))
                } else {
                    format!("{}{c}", " ".repeat(pad))
                }
            })
            .collect();
        println!("  {}", parts.join("  ").trim_end());
    };
    line(headers.iter().map(|s| s.to_string()).collect());
    line(w.iter().map(|n| "-".repeat(*n)).collect());
    for r in rows {
        line(r.clone());
    }
}

/// user+sys CPU seconds of a process, from /proc/<pid>/stat.
pub fn proc_cpu(pid: i32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // fields after the command: state(3) … utime(14) stime(15)
    let ut: f64 = f.get(11)?.parse().ok()?;
    let st: f64 = f.get(12)?.parse().ok()?;
    Some((ut + st) / clk_tck())
}

/// CPU seconds of one live process, all its threads, from each thread's
/// `/proc/<pid>/task/<tid>/schedstat` (nanoseconds on the CPU: exact, where
/// `/proc/<pid>/stat` counts 10 ms ticks, too coarse for many short-lived
/// measurements of dozens of processes). `None` once the process is gone.
pub fn process_cpu_exact(pid: i32) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut ns: u64 = 0;
    for t in tasks.flatten() {
        let path = t.path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(path) {
            ns += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    Some(ns as f64 / 1e9)
}

/// This process's live children (direct ones: the spawner's process groups
/// are its children) with their CPU seconds so far. Persistent executors
/// are not reaped while a measurement runs, so `RUSAGE_CHILDREN` alone
/// misses them; see [`children_cpu_between`].
pub fn live_children_cpu() -> Vec<(i32, f64)> {
    let me = std::process::id().to_string();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // fields after the command: state ppid …
        let ppid = stat
            .rfind(')')
            .and_then(|i| stat[i + 2..].split_whitespace().nth(1));
        if ppid == Some(me.as_str()) {
            if let Some(cpu) = process_cpu_exact(pid) {
                out.push((pid, cpu));
            }
        }
    }
    out
}

/// CPU seconds the children used between two points: what the reaped ones
/// added to `RUSAGE_CHILDREN`, plus what the live ones used (a child live
/// at the first point counts from there, whether it is reaped by the
/// second or still live).
pub fn children_cpu_between(
    rusage_before: f64,
    live_before: &[(i32, f64)],
    rusage_after: f64,
    live_after: &[(i32, f64)],
) -> f64 {
    let earlier: f64 = live_before.iter().map(|(_, c)| c).sum();
    let later: f64 = live_after.iter().map(|(_, c)| c).sum();
    (rusage_after - rusage_before) + later - earlier
}

pub fn rusage(who: i32) -> f64 {
    // SAFETY: getrusage writes into the zeroed struct we own.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(who, &mut ru);
        let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
        tv(ru.ru_utime) + tv(ru.ru_stime)
    }
}

/// CPU seconds used by this process (all threads).
pub fn self_cpu() -> f64 {
    rusage(libc::RUSAGE_SELF)
}

/// Runs a benchmark until it ends or Ctrl-C, then drops every database it
/// created (their names are pushed into the shared list) and exits 1 on error.
pub async fn run_and_clean_up<F, Fut>(name: &str, admin_url: &str, run: F)
where
    F: FnOnce(Arc<Mutex<Vec<String>>>) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let created: Arc<Mutex<Vec<String>>> = Arc::default();
    let res = tokio::select! {
        r = run(created.clone()) => r,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    let names = created.lock().unwrap_or_else(|p| p.into_inner()).clone();
    drop_databases(admin_url, &names).await;
    if let Err(e) = res {
        eprintln!("{name} failed: {}", chain_text(&e));
        std::process::exit(1);
    }
}

/// An error and its causes, each cause left out where the text before it
/// already says it (the runtime's errors quote their source: "… pool timed
/// out …: pool timed out" was printed twice).
pub fn chain_text(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

/// A `kB` field of /proc/<pid>/status (VmRSS, VmHWM, …), in KiB.
pub fn proc_status_kb(pid: i32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// Creates an empty database `<prefix>_<random>` on the admin server and
/// records it for clean-up; returns its name and URL.
pub async fn empty_database(
    admin: &Db,
    admin_url: &str,
    prefix: &str,
    created: &Mutex<Vec<String>>,
) -> Result<(String, String)> {
    let name = format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(admin.pool())
        .await?;
    created
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(name.clone());
    Ok((name.clone(), db_url(admin_url, &name)))
}

/// Creates a fresh database `<prefix>_<random>` on the admin server, records
/// it for clean-up, migrates it, and returns its URL.
pub async fn fresh_database(
    admin: &Db,
    admin_url: &str,
    prefix: &str,
    created: &Mutex<Vec<String>>,
) -> Result<(String, String)> {
    let (name, url) = empty_database(admin, admin_url, prefix, created).await?;
    let db = Db::connect(&url, 1).await?;
    db.migrate().await?;
    db.pool().close().await;
    Ok((name, url))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_quoted_by_the_error_before_it_is_not_repeated() {
        let e = anyhow::anyhow!("pool timed out while waiting")
            .context("cannot connect: pool timed out while waiting. Is the server running?")
            .context("connecting to DATABASE_URL");
        assert_eq!(
            chain_text(&e),
            "connecting to DATABASE_URL: cannot connect: pool timed out while waiting. Is the server running?"
        );
    }
}
