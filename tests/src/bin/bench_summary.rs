//! Merges the JSON parts the benchmark binaries wrote (`--json-out`) into one
//! summary (run by `scripts/bench` at the end) and prints every target with
//! its measured value and met/missed.
//!
//!   bench_summary --parts target/bench/parts --out target/bench/summary.json

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use tests::bench::print_targets;

#[derive(Parser, Debug)]
#[command(about = "Merge the benchmarks' JSON parts into one summary")]
struct Args {
    /// Directory of the parts (*.json), merged in name order.
    #[arg(long)]
    parts: PathBuf,
    /// The summary file to write.
    #[arg(long, default_value = "target/bench/summary.json")]
    out: PathBuf,
    /// Extra setup fields, KEY=VALUE (e.g. mode=quick).
    #[arg(long = "set")]
    set: Vec<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&args.parts)
        .with_context(|| format!("reading {}", args.parts.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no parts (*.json) in {}", args.parts.display());
    }
    let mut benches = Vec::new();
    let mut targets = Vec::new();
    let mut setup = Value::Null;
    for f in &files {
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        )
        .with_context(|| format!("parsing {}", f.display()))?;
        if setup.is_null() {
            setup = v["setup"].clone();
        }
        let bench = v["bench"].as_str().unwrap_or("").to_string();
        for t in v["targets"].as_array().into_iter().flatten() {
            let mut t = t.clone();
            t["bench"] = json!(bench);
            targets.push(t);
        }
        benches.push(v);
    }
    if let Some(obj) = setup.as_object_mut() {
        // the load average differs per part; each part keeps its own
        obj.remove("load_average");
        for kv in &args.set {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--set {kv}: want KEY=VALUE"))?;
            obj.insert(k.into(), json!(v));
        }
    }
    targets.sort_by(|a, b| {
        a["id"]
            .as_str()
            .unwrap_or("")
            .cmp(b["id"].as_str().unwrap_or(""))
    });
    let met = targets.iter().filter(|t| t["met"] == json!(true)).count();
    let summary = json!({
        "generated_at": chrono::Utc::now().to_rfc3339(),
        "setup": setup,
        "targets_met": met,
        "targets_total": targets.len(),
        "targets": targets,
        "benches": benches,
    });
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&summary)?)
        .with_context(|| format!("writing the summary to {}", args.out.display()))?;
    println!("== summary: {met} of {} targets met", targets.len());
    let s = &summary["setup"];
    println!(
        "setup       : {} cores ({}), PostgreSQL {} (fsync={}, synchronous_commit={}) on {}, {} build, git {}{}",
        s["cores"],
        s["cpu_model"].as_str().unwrap_or("?"),
        s["postgresql_version"].as_str().unwrap_or("?"),
        s["postgresql_settings"]["fsync"].as_str().unwrap_or("?"),
        s["postgresql_settings"]["synchronous_commit"].as_str().unwrap_or("?"),
        s["postgresql_host"].as_str().unwrap_or("?"),
        s["build_profile"].as_str().unwrap_or("?"),
        s["git_commit"].as_str().unwrap_or("?"),
        if s["git_dirty"] == json!(true) { " + uncommitted changes" } else { "" },
    );
    print_targets(
        summary["targets"]
            .as_array()
            .map(|v| v.as_slice())
            .unwrap_or(&[]),
    );
    println!("(every figure with its setup: {})", args.out.display());
    Ok(())
}
