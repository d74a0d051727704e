//! Helpers shared by the benchmark binaries (tests/src/bin): CPU and machine
//! readings, percentiles, tables, and the setup header every benchmark prints.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use supervisor::db::Db;

pub use crate::db_url;

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

/// Machine, PostgreSQL and build facts.
pub async fn print_setup(admin: &Db, url: &str) -> Result<()> {
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
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0))
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    println!(
        "machine     : {cpu_model}; nproc {nproc}; memory {mem}; Linux {kernel}; load average {}",
        loadavg()
    );
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(admin.pool())
        .await?;
    let mut settings = Vec::new();
    for s in [
        "fsync",
        "synchronous_commit",
        "full_page_writes",
        "shared_buffers",
        "max_connections",
        "autovacuum",
        "work_mem",
    ] {
        let v: String = sqlx::query_scalar(&format!("SHOW {s}"))
            .fetch_one(admin.pool())
            .await?;
        settings.push(format!("{s}={v}"));
    }
    println!("postgresql  : {version}; {}", settings.join(", "));
    let git = std::process::Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "rev-parse",
            "--short",
            "HEAD",
        ])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let dirty = std::process::Command::new("git")
        .args([
            "-C",
            env!("CARGO_MANIFEST_DIR"),
            "status",
            "--porcelain",
            "--untracked-files=no",
        ])
        .output()
        .ok()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    println!(
        "build       : {} profile (debug_assertions {}); git {git}{}; database server at {}",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        if cfg!(debug_assertions) { "on" } else { "off" },
        if dirty { " + uncommitted changes" } else { "" },
        db_host(url),
    );
    Ok(())
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
        eprintln!("{name} failed: {e:#}");
        std::process::exit(1);
    }
}
