//! Generates the Rust types of the executor protocol from `proto/` with protox,
//! a pure-Rust protobuf compiler: building needs no `protoc` binary.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let file = root.join("durable/executor/v1/executor.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    // `sqlx::migrate!` embeds the migrations at compile time: a new file in
    // the directory must rebuild the crate (else the binary lacks it)
    let migrations = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    println!("cargo:rerun-if-changed={}", migrations.display());
    // the newest migration's version, for `--version`: two builds of one
    // release number that need different schemas tell themselves apart
    let newest = std::fs::read_dir(&migrations)?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.ends_with(".sql")
                .then(|| name.split('_').next().and_then(|v| v.parse::<u64>().ok()))
                .flatten()
        })
        .max()
        .unwrap_or(0);
    println!("cargo:rustc-env=DURABLE_SCHEMA_VERSION={newest}");
    let fds = protox::compile([&file], [&root])?;
    prost_build::Config::new()
        // Deterministic encoding: map entries in key order, like Go's and
        // Python's deterministic marshalling, so golden frames match byte for byte.
        .btree_map(["."])
        .compile_fds(fds)?;
    Ok(())
}
