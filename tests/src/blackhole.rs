//! A TCP proxy in front of PostgreSQL that can blackhole its connections
//! (stop forwarding, keep them open), as a partitioned network does.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub struct Blackhole {
    pub port: u16,
    paused: Arc<AtomicBool>,
    reset: Arc<tokio::sync::Notify>,
    upstream: String,
}

impl Blackhole {
    /// A proxy in front of the server that `url` names.
    pub async fn start(url: &str) -> Blackhole {
        let upstream = url_host_port(url).to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let paused = Arc::new(AtomicBool::new(false));
        let reset = Arc::new(tokio::sync::Notify::new());
        let (p, up, rs) = (paused.clone(), upstream.clone(), reset.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(&up).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, p.clone(), rs.clone()));
                tokio::spawn(pipe(sr, cw, p.clone(), rs.clone()));
            }
        });
        Blackhole {
            port,
            paused,
            reset,
            upstream,
        }
    }

    /// `url` with its server replaced by this proxy.
    pub fn url(&self, url: &str) -> String {
        url.replacen(&self.upstream, &format!("127.0.0.1:{}", self.port), 1)
    }

    /// From now on nothing goes through, in either direction; connections
    /// stay open (and new ones are accepted, then hang).
    pub fn cut(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    /// Closes every connection open now (each side reads EOF, with no error
    /// message from the server), as a broken network or a crashed host does.
    pub fn reset(&self) {
        self.reset.notify_waiters();
    }

    /// Forwarding resumes (what was held back goes through).
    pub fn heal(&self) {
        self.paused.store(false, Ordering::SeqCst);
    }
}

/// `host:port` of a `postgres://user@host:port/db` URL.
fn url_host_port(url: &str) -> &str {
    let rest = &url[url
        .find('@')
        .map(|i| i + 1)
        .unwrap_or(url.find("://").map(|i| i + 3).unwrap_or(0))..];
    &rest[..rest.find('/').unwrap_or(rest.len())]
}

async fn pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    paused: Arc<AtomicBool>,
    reset: Arc<tokio::sync::Notify>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        while paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let n = tokio::select! {
            read = r.read(&mut buf) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = reset.notified() => return,
        };
        while paused.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
