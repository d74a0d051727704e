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
    let fds = protox::compile([&file], [&root])?;
    prost_build::Config::new()
        // Deterministic encoding: map entries in key order, like Go's and
        // Python's deterministic marshalling, so golden frames match byte for byte.
        .btree_map(["."])
        .compile_fds(fds)?;
    Ok(())
}
