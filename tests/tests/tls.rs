//! TLS to PostgreSQL, as managed services require it: with `sslmode=require`
//! every connection of the CLI and of a worker's pool is encrypted; with
//! `sslmode=verify-full` the server's certificate is checked against
//! `sslrootcert` (or the system's CA store), and a certificate that is not
//! trusted is refused with a message that says what to give. A private
//! cluster with `ssl = on` and a self-signed certificate for 127.0.0.1.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Output, Stdio};

use supervisor::db::Db;
use tests::chaos::PrivatePg;

fn cli(url: &str, args: &[&str]) -> Output {
    Command::new(tests::supervisor_bin())
        .args(args)
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .output()
        .expect("run supervisor")
}

/// Writes `text` to `path`, owned by the cluster's user (as root: `postgres`), mode 0600.
fn write_private(path: &std::path::Path, text: &str) {
    std::fs::write(path, text).expect("write");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    if nix::unistd::geteuid().is_root() {
        let pg = nix::unistd::User::from_name("postgres")
            .expect("users")
            .expect("a postgres user");
        std::os::unix::fs::chown(path, Some(pg.uid.as_raw()), Some(pg.gid.as_raw()))
            .expect("chown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_encrypted_and_certificates_checked_when_the_url_asks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pg = PrivatePg::start(dir.path())
        .await
        .expect("a private cluster");
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()])
        .expect("a self-signed certificate");
    let data = dir.path().join("data");
    write_private(&data.join("server.crt"), &cert.cert.pem());
    write_private(&data.join("server.key"), &cert.key_pair.serialize_pem());
    let root = dir.path().join("root.crt");
    std::fs::write(&root, cert.cert.pem()).expect("root.crt");
    let plain = Db::connect(&pg.url, 2).await.expect("connect");
    for sql in ["ALTER SYSTEM SET ssl = on", "SELECT pg_reload_conf()"] {
        sqlx::raw_sql(sql)
            .execute(plain.pool())
            .await
            .expect("ssl on");
    }
    plain.pool().close().await;
    // (a reload takes effect for connections made after it)
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;

    let require = format!("{}?sslmode=require", pg.url);
    let out = cli(&require, &["migrate"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&require, &["runs", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let db = Db::connect(&require, 2).await.expect("connect with TLS");
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(db.pool())
        .await
        .expect("pg_stat_ssl");
    assert!(ssl, "the pool's connection is encrypted");
    db.pool().close().await;

    // the certificate is checked: not trusted without its CA ...
    let verify = format!("{}?sslmode=verify-full", pg.url);
    let out = cli(&verify, &["runs"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("TLS") && err.contains("sslrootcert"), "{err}");
    // ... trusted with it
    let verify = format!("{verify}&sslrootcert={}", root.display());
    let out = cli(&verify, &["runs"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    pg.stop("fast").await.expect("stop");
}
