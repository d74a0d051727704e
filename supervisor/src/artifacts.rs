//! The artifact store: content-addressed blobs (by sha256) that stream in
//! both directions, one chunk (`artifact_chunk_bytes`, 1 MiB by default) at
//! a time, so no artifact is ever held whole in memory.
//!
//! Two backends, chosen by the worker config's `artifact_store`:
//! - `postgres` (the default): a blob that fits in one chunk is one bytea in
//!   its `durable.artifact_blobs` row; a larger one is rows of
//!   `durable.artifact_chunks`, each written by its own statement under a
//!   fresh upload id and made part of the blob only when the blob row is
//!   inserted after the whole file was hashed and counted. Works across
//!   hosts with nothing but the database.
//! - `directory`: the file `<artifact_dir>/<sha[0..2]>/<sha>` on a volume all
//!   worker hosts share, written to `.<sha>.<random>.part` beside it and
//!   renamed into place once complete and verified; the blob row records
//!   that the bytes are there.
//!
//! Readers follow the blob row, whichever backend this process writes to:
//! rows from before the chunked store (one bytea) stay readable.
//!
//! Uploads ([`ArtifactStore::put_file`]) check the executor's declared size
//! and sha256 while streaming: a mismatch is [`StoreError::SizeMismatch`] /
//! [`StoreError::DigestMismatch`] (the attempt fails with
//! `ARTIFACT_DIGEST_MISMATCH`) and leaves no blob, no chunk and no file. A
//! blob that already exists is claimed and not uploaded again (the file is
//! still hashed: a manifest cannot name bytes it does not have). Garbage (a
//! verified upload whose attempt never committed) and its collection rule
//! are described in migrations/20261203000003_artifact_store.sql.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::config::{ArtifactBackend, WorkerConfig};
use crate::db::{BlobPlace, BlobRef, Db, DbError, Recorded};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("artifact {name:?}: manifest says {declared} bytes, file has {actual}")]
    SizeMismatch {
        name: String,
        declared: u64,
        actual: u64,
    },
    #[error("artifact {name:?}: sha256 mismatch (manifest {declared}, file {actual})")]
    DigestMismatch {
        name: String,
        declared: String,
        actual: String,
    },
    #[error("artifact {name:?}: cannot read {}: {source}", path.display())]
    Read {
        name: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the artifact directory {}: {source}; check that artifact_dir is mounted and writable", dir.display())]
    Directory {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("blob {sha256} is stored in a directory store and this process has no artifact_dir: set artifact_dir (worker config), --artifact-dir or DURABLE_ARTIFACT_DIR to the shared directory")]
    NoDirectory { sha256: String },
    #[error("blob {sha256} is stored in a directory store, and the artifact directory {} does not exist here: point artifact_dir (worker config), --artifact-dir or DURABLE_ARTIFACT_DIR at the shared directory", dir.display())]
    DirectoryMissing { sha256: String, dir: PathBuf },
    #[error("blob {sha256}: {problem}; the stored bytes are damaged")]
    Corrupt { sha256: String, problem: String },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl StoreError {
    /// The file is not what the manifest declared (the attempt's fault, not
    /// the store's).
    pub fn is_mismatch(&self) -> bool {
        matches!(
            self,
            StoreError::SizeMismatch { .. } | StoreError::DigestMismatch { .. }
        )
    }
}

/// A handle on the configured store (cheap to make: a pool and a few fields).
#[derive(Debug, Clone)]
pub struct ArtifactStore {
    db: Db,
    backend: ArtifactBackend,
    dir: Option<PathBuf>,
    chunk: usize,
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// `<dir>/<sha[0..2]>/<sha>`; `sha` must be 64 hex digits.
/// How much older than its blob's removal a file must be to be deleted: a
/// re-upload of the same bytes after the removal writes a newer file (kept);
/// the margin covers clock skew between the database and the volume's hosts.
const FILE_REMOVAL_MARGIN: std::time::Duration = std::time::Duration::from_secs(60);

/// How long a file written near or after its blob's removal (within
/// [`FILE_REMOVAL_MARGIN`] of it) stays before it is taken for an orphan:
/// an upload renames its file into place and records its blob row at once,
/// so a file that long without a row is nobody's.
const ORPHAN_FILE_AGE: std::time::Duration = std::time::Duration::from_secs(600);

/// What a pass does with one removed blob's file.
#[derive(Debug, PartialEq, Eq)]
enum FileFate {
    /// Written before the removal, or unclaimed for [`ORPHAN_FILE_AGE`]: deleted.
    Delete,
    /// Written near or after the removal, recently: a re-upload whose row is
    /// on its way, or the removed blob's own file if the blob lived less
    /// than the margin. Kept, and the entry stays queued for a later pass.
    Wait,
}

/// What a pass did with one removed blob's file.
enum Removal {
    Deleted,
    /// Not there, its fan-out directory is: deleted by another pass.
    Missing,
    /// Kept, its entry queued for a later pass ([`FileFate::Wait`]).
    Waits,
    /// Not in this directory at all (no fan-out directory for it): kept
    /// queued for a process that mounts the store's directory.
    NotHere,
}

fn file_fate(
    modified: std::time::SystemTime,
    removed_at: std::time::SystemTime,
    now: std::time::SystemTime,
) -> FileFate {
    let cutoff = removed_at
        .checked_sub(FILE_REMOVAL_MARGIN)
        .unwrap_or(std::time::UNIX_EPOCH);
    let idle = now.duration_since(modified).unwrap_or_default();
    if modified < cutoff || idle > ORPHAN_FILE_AGE {
        FileFate::Delete
    } else {
        FileFate::Wait
    }
}

/// Deletes the files of removed directory-store blobs (queued by the
/// database when their rows went), each one no blob row names again: a file
/// older than its removal at once, a newer one once nobody has claimed it
/// for [`ORPHAN_FILE_AGE`] (its entry stays queued until then; before, it
/// was dropped and the file stayed for good). Returns how many were deleted.
pub async fn remove_deleted_files(db: &Db, dir: &Path) -> Result<u64, StoreError> {
    // a directory that is not there (a typo, a volume not mounted) would
    // read as "every file already deleted" and drop the queue, leaving the
    // real files for ever (retention audit)
    let meta = tokio::fs::metadata(dir).await;
    match meta {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(StoreError::Directory {
                dir: dir.to_path_buf(),
                source: std::io::Error::other("not a directory"),
            })
        }
        Err(source) => {
            return Err(StoreError::Directory {
                dir: dir.to_path_buf(),
                source,
            })
        }
    }
    let mut deleted = 0;
    loop {
        let queued = db.removed_blob_files(500).await?;
        if queued.is_empty() {
            return Ok(deleted);
        }
        let mut done = Vec::with_capacity(queued.len());
        let mut waiting = 0;
        // the last round reads every entry still queued: its count is theirs
        let mut not_here = 0u64;
        for (sha, removed_at) in queued {
            if !is_sha256_hex(&sha) {
                done.push(sha);
                continue;
            }
            let path = blob_path(dir, &sha);
            let removed_at = std::time::SystemTime::from(removed_at);
            let res = blocking(move || match std::fs::metadata(&path) {
                Ok(m) => {
                    let modified = m.modified()?;
                    match file_fate(modified, removed_at, std::time::SystemTime::now()) {
                        FileFate::Delete => std::fs::remove_file(&path).map(|_| Removal::Deleted),
                        FileFate::Wait => Ok(Removal::Waits),
                    }
                }
                // gone from its fan-out directory: deleted already (by
                // another pass); no fan-out directory at all: this is not
                // the directory the file was stored in (an empty mount
                // point), and the entry stays for one that is
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    match path.parent().map(std::fs::metadata) {
                        Some(Ok(_)) => Ok(Removal::Missing),
                        _ => Ok(Removal::NotHere),
                    }
                }
                Err(e) => Err(e),
            })
            .await;
            match res {
                Ok(Removal::Deleted) => deleted += 1,
                Ok(Removal::Missing) => {}
                Ok(Removal::NotHere) => {
                    not_here += 1;
                    continue;
                }
                Ok(Removal::Waits) => {
                    waiting += 1;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(sha256 = %sha, error = %e, "cannot delete a removed blob's file; kept for the next pass");
                    continue;
                }
            }
            done.push(sha);
        }
        if waiting > 0 {
            tracing::debug!(
                files = waiting,
                "removed blobs' files written near their removal are kept for a later pass"
            );
        }
        if not_here > 0 && done.is_empty() {
            tracing::warn!(
                files = not_here,
                dir = %dir.display(),
                "removed blobs' files are queued for deletion, but this artifact directory has no fan-out directory for them: is it the store's directory (mounted)? They stay queued for a process that mounts it"
            );
        }
        if done.is_empty() {
            return Ok(deleted);
        }
        db.forget_removed_blob_files(&done).await?;
    }
}

fn blob_path(dir: &Path, sha: &str) -> PathBuf {
    dir.join(&sha[..2]).join(sha)
}

/// Fills `buf` (up to its capacity) from `f`; an empty `buf` is the end.
fn read_full(f: &mut std::fs::File, buf: &mut Vec<u8>, want: usize) -> std::io::Result<()> {
    buf.clear();
    buf.resize(want, 0);
    let mut got = 0;
    while got < want {
        match f.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    buf.truncate(got);
    Ok(())
}

/// Runs blocking file work (read, hash, write one chunk) off the runtime
/// threads, so hashing a GiB never stalls the heartbeat or other attempts.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(std::io::Error::other(format!(
            "a blocking artifact task failed: {e}"
        ))),
    }
}

/// An output file read chunk by chunk, hashed and counted as it goes.
struct Source {
    name: String,
    path: PathBuf,
    file: Option<std::fs::File>,
    hasher: Option<Sha256>,
    size: u64,
    declared: u64,
    chunk: usize,
}

impl Source {
    async fn open(
        name: &str,
        path: &Path,
        declared: u64,
        chunk: usize,
    ) -> Result<Source, StoreError> {
        let p = path.to_owned();
        let file = blocking(move || std::fs::File::open(p))
            .await
            .map_err(|source| StoreError::Read {
                name: name.to_owned(),
                path: path.to_owned(),
                source,
            })?;
        Ok(Source {
            name: name.to_owned(),
            path: path.to_owned(),
            file: Some(file),
            hasher: Some(Sha256::new()),
            size: 0,
            declared,
            chunk,
        })
    }

    /// The next chunk into `buf` (empty at the end). More bytes than
    /// declared stop the read at once: a runaway file is not uploaded.
    async fn next(&mut self, mut buf: Vec<u8>) -> Result<Vec<u8>, StoreError> {
        let (Some(mut f), Some(mut h)) = (self.file.take(), self.hasher.take()) else {
            return Ok(Vec::new());
        };
        let want = self.chunk;
        let r = blocking(move || {
            read_full(&mut f, &mut buf, want)?;
            h.update(&buf);
            Ok((f, h, buf))
        })
        .await;
        let (f, h, buf) = r.map_err(|source| StoreError::Read {
            name: self.name.clone(),
            path: self.path.clone(),
            source,
        })?;
        self.size += buf.len() as u64;
        if self.size > self.declared {
            return Err(StoreError::SizeMismatch {
                name: self.name.clone(),
                declared: self.declared,
                actual: self.size.saturating_add(file_rest(&f)),
            });
        }
        self.file = Some(f);
        self.hasher = Some(h);
        Ok(buf)
    }

    /// The whole file was read: size and sha256 against the manifest.
    fn verify(&mut self, declared_sha: &str) -> Result<String, StoreError> {
        let sha = hex::encode(self.hasher.take().unwrap_or_default().finalize());
        if self.size != self.declared {
            return Err(StoreError::SizeMismatch {
                name: self.name.clone(),
                declared: self.declared,
                actual: self.size,
            });
        }
        if sha != declared_sha {
            return Err(StoreError::DigestMismatch {
                name: self.name.clone(),
                declared: declared_sha.to_owned(),
                actual: sha,
            });
        }
        Ok(sha)
    }
}

/// What is left of a file after its current position (for a message).
fn file_rest(f: &std::fs::File) -> u64 {
    use std::io::Seek;
    let mut f = f;
    match (f.stream_position(), f.metadata()) {
        (Ok(pos), Ok(m)) => m.len().saturating_sub(pos),
        _ => 0,
    }
}

impl ArtifactStore {
    pub fn new(db: Db, cfg: &WorkerConfig) -> ArtifactStore {
        ArtifactStore {
            db,
            backend: cfg.artifact_store,
            dir: cfg.artifact_dir.clone(),
            chunk: cfg.artifact_chunk_bytes.clamp(
                crate::config::MIN_ARTIFACT_CHUNK_BYTES,
                crate::config::MAX_ARTIFACT_CHUNK_BYTES,
            ),
        }
    }

    /// A reader-only store (the CLI): reads every backend, `dir` for blobs
    /// of a directory store.
    pub fn reader(db: Db, dir: Option<PathBuf>) -> ArtifactStore {
        ArtifactStore {
            db,
            backend: ArtifactBackend::Postgres,
            dir,
            chunk: 1 << 20,
        }
    }

    /// Stores the file at `path` as the blob `sha256` (the manifest's
    /// declaration, with `size`), streaming it in chunks and checking both
    /// as it goes. Returns the blob's sha256 (lower-case). On a mismatch or
    /// any error nothing of this upload remains; an existing blob of that
    /// digest is claimed, not uploaded again.
    pub async fn put_file(
        &self,
        name: &str,
        path: &Path,
        size: u64,
        sha256: &str,
    ) -> Result<String, StoreError> {
        let declared = sha256.to_ascii_lowercase();
        let mut src = Source::open(name, path, size, self.chunk).await?;
        if !is_sha256_hex(&declared) {
            // no file can match it; and it must never become a path
            return Err(StoreError::DigestMismatch {
                name: name.to_owned(),
                declared,
                actual: "(not read: the manifest's sha256 is not 64 hex digits)".into(),
            });
        }
        if self.db.claim_blob(&declared).await?.is_some() {
            // stored already: only prove the file is those bytes
            let mut buf = Vec::with_capacity(self.chunk);
            loop {
                buf = src.next(buf).await?;
                if buf.is_empty() {
                    break;
                }
            }
            return src.verify(&declared);
        }
        match (self.backend, &self.dir) {
            (ArtifactBackend::Directory, Some(dir)) => {
                self.put_directory(dir, &mut src, &declared).await
            }
            (ArtifactBackend::Directory, None) => Err(StoreError::NoDirectory { sha256: declared }),
            (ArtifactBackend::Postgres, _) => self.put_postgres(&mut src, &declared).await,
        }
    }

    async fn put_postgres(&self, src: &mut Source, declared: &str) -> Result<String, StoreError> {
        let upload_id = Uuid::new_v4();
        let mut started = false;
        let res = self
            .stream_chunks(src, declared, upload_id, &mut started)
            .await;
        if res.is_err() && started {
            // best effort: a crash here leaves chunks the garbage rule removes
            if let Err(e) = self.db.drop_upload(upload_id).await {
                tracing::warn!(error = %e, %upload_id, "could not delete an unfinished upload's chunks; the retention rule collects them");
            }
        }
        res
    }

    async fn stream_chunks(
        &self,
        src: &mut Source,
        declared: &str,
        upload_id: Uuid,
        started: &mut bool,
    ) -> Result<String, StoreError> {
        // one chunk is held back: a file that ends within it is stored inline
        let mut pending = src.next(Vec::with_capacity(self.chunk)).await?;
        let mut spare = Vec::with_capacity(self.chunk);
        let mut n: i32 = 0;
        loop {
            let next = src.next(std::mem::take(&mut spare)).await?;
            if next.is_empty() && n == 0 {
                let sha = src.verify(declared)?;
                self.db.record_inline_blob(&sha, &pending).await?;
                return Ok(sha);
            }
            *started = true;
            self.db.put_chunk(upload_id, n, &pending).await?;
            n = n.checked_add(1).ok_or_else(|| StoreError::Corrupt {
                sha256: declared.to_owned(),
                problem: "more than 2^31 chunks: raise artifact_chunk_bytes".into(),
            })?;
            if next.is_empty() {
                break;
            }
            spare = std::mem::replace(&mut pending, next);
        }
        let sha = src.verify(declared)?;
        let size = i64::try_from(src.size).unwrap_or(i64::MAX);
        if self
            .db
            .record_chunked_blob(&sha, size, upload_id, n)
            .await?
            == Recorded::Existing
        {
            // the same bytes were stored meanwhile: ours are not needed
            self.db.drop_upload(upload_id).await?;
        }
        Ok(sha)
    }

    async fn put_directory(
        &self,
        dir: &Path,
        src: &mut Source,
        declared: &str,
    ) -> Result<String, StoreError> {
        let shard = dir.join(&declared[..2]);
        let tmp = shard.join(format!(".{declared}.{}.part", Uuid::new_v4().simple()));
        let dir_err = |source| StoreError::Directory {
            dir: dir.to_owned(),
            source,
        };
        let (s, t) = (shard.clone(), tmp.clone());
        let file = blocking(move || {
            std::fs::create_dir_all(&s)?;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&t)
        })
        .await
        .map_err(dir_err)?;
        // removed unless it becomes the blob, also when the upload is
        // abandoned midway (the attempt's future dropped at a stop)
        let mut part = PartFile(Some(tmp.clone()));
        let res = self.fill_file(file, src, declared, &tmp).await;
        let res = match res {
            Ok(sha) => {
                let (t, fin, s) = (tmp.clone(), blob_path(dir, &sha), shard.clone());
                blocking(move || {
                    std::fs::set_permissions(
                        &t,
                        std::os::unix::fs::PermissionsExt::from_mode(0o444),
                    )?;
                    // the same bytes from another host may be there already: same content
                    std::fs::rename(&t, &fin)?;
                    std::fs::File::open(&s)?.sync_all()
                })
                .await
                .map_err(dir_err)
                .map(|_| sha)
            }
            Err(e) => Err(e),
        };
        let sha = res?;
        part.0 = None;
        let size = i64::try_from(src.size).unwrap_or(i64::MAX);
        self.db.record_directory_blob(&sha, size).await?;
        Ok(sha)
    }

    async fn fill_file(
        &self,
        mut file: std::fs::File,
        src: &mut Source,
        declared: &str,
        tmp: &Path,
    ) -> Result<String, StoreError> {
        let mut buf = Vec::with_capacity(self.chunk);
        loop {
            buf = src.next(buf).await?;
            if buf.is_empty() {
                break;
            }
            let (f, b) = blocking(move || {
                file.write_all(&buf)?;
                Ok((file, buf))
            })
            .await
            .map_err(|source| StoreError::Write {
                path: tmp.to_owned(),
                source,
            })?;
            file = f;
            buf = b;
        }
        let sha = src.verify(declared)?;
        blocking(move || file.sync_all())
            .await
            .map_err(|source| StoreError::Write {
                path: tmp.to_owned(),
                source,
            })?;
        Ok(sha)
    }

    /// Opens a blob for reading, chunk by chunk, checked against its size
    /// and sha256 at the end.
    pub async fn open(&self, blob: &BlobRef) -> Result<BlobReader, StoreError> {
        let file = match blob.place {
            BlobPlace::Directory => {
                let Some(dir) = &self.dir else {
                    return Err(StoreError::NoDirectory {
                        sha256: blob.sha256.clone(),
                    });
                };
                if !is_sha256_hex(&blob.sha256) {
                    return Err(StoreError::Corrupt {
                        sha256: blob.sha256.clone(),
                        problem: "its sha256 is not 64 hex digits".into(),
                    });
                }
                if !dir.is_dir() {
                    return Err(StoreError::DirectoryMissing {
                        sha256: blob.sha256.clone(),
                        dir: dir.clone(),
                    });
                }
                let path = blob_path(dir, &blob.sha256);
                let p = path.clone();
                let f = blocking(move || std::fs::File::open(p))
                    .await
                    .map_err(|source| StoreError::Corrupt {
                        sha256: blob.sha256.clone(),
                        problem: format!("its file {}: {source}", path.display()),
                    })?;
                Some(f)
            }
            _ => None,
        };
        Ok(BlobReader {
            db: self.db.clone(),
            blob: blob.clone(),
            chunk: self.chunk,
            file,
            hasher: Some(Sha256::new()),
            read: 0,
            next_chunk: 0,
            done: false,
        })
    }

    /// Streams a blob into a new file at `path` (which must not exist),
    /// read-only (0444) once complete and verified; on any error the file is
    /// removed.
    pub async fn copy_to_file(&self, blob: &BlobRef, path: &Path) -> Result<(), StoreError> {
        let mut reader = self.open(blob).await?;
        let p = path.to_owned();
        let write_err = |source| StoreError::Write {
            path: path.to_owned(),
            source,
        };
        let mut file = Some(
            blocking(move || {
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(p)
            })
            .await
            .map_err(write_err)?,
        );
        let res = async {
            while let Some(chunk) = reader.next_chunk().await? {
                let Some(mut f) = file.take() else { break };
                let f = blocking(move || {
                    f.write_all(&chunk)?;
                    Ok(f)
                })
                .await
                .map_err(write_err)?;
                file = Some(f);
            }
            let Some(f) = file.take() else {
                return Ok(());
            };
            blocking(move || {
                f.sync_all()?;
                f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o444))
            })
            .await
            .map_err(write_err)
        }
        .await;
        if res.is_err() {
            let p = path.to_owned();
            let _ = blocking(move || std::fs::remove_file(p)).await;
        }
        res
    }
}

/// One blob's bytes, chunk by chunk; the end is only reported once size and
/// sha256 matched the blob row (else [`StoreError::Corrupt`]).
pub struct BlobReader {
    db: Db,
    blob: BlobRef,
    chunk: usize,
    file: Option<std::fs::File>,
    hasher: Option<Sha256>,
    read: i64,
    next_chunk: i32,
    done: bool,
}

impl BlobReader {
    pub fn blob(&self) -> &BlobRef {
        &self.blob
    }

    fn corrupt(&self, problem: String) -> StoreError {
        StoreError::Corrupt {
            sha256: self.blob.sha256.clone(),
            problem,
        }
    }

    /// The next chunk, or `None` at the (verified) end.
    pub async fn next_chunk(&mut self) -> Result<Option<Vec<u8>>, StoreError> {
        if self.done {
            return Ok(None);
        }
        let bytes = match &self.blob.place {
            BlobPlace::Inline => {
                if self.read >= self.blob.size {
                    Vec::new()
                } else {
                    self.db
                        .inline_slice(&self.blob.sha256, self.read, self.chunk as i64)
                        .await?
                        .ok_or_else(|| self.corrupt("its row is gone".into()))?
                }
            }
            BlobPlace::Chunks { upload_id, chunks } => {
                if self.next_chunk >= *chunks {
                    Vec::new()
                } else {
                    let c = self
                        .db
                        .blob_chunk(*upload_id, self.next_chunk)
                        .await?
                        .ok_or_else(|| {
                            self.corrupt(format!(
                                "chunk {} of {chunks} is missing",
                                self.next_chunk
                            ))
                        })?;
                    self.next_chunk += 1;
                    c
                }
            }
            BlobPlace::Directory => match self.file.take() {
                None => Vec::new(),
                Some(mut f) => {
                    let want = self.chunk;
                    let (f, buf) = blocking(move || {
                        let mut buf = Vec::new();
                        read_full(&mut f, &mut buf, want)?;
                        Ok((f, buf))
                    })
                    .await
                    .map_err(|e| self.corrupt(format!("reading its file: {e}")))?;
                    self.file = Some(f);
                    buf
                }
            },
        };
        if bytes.is_empty() {
            self.done = true;
            let sha = hex::encode(self.hasher.take().unwrap_or_default().finalize());
            if self.read != self.blob.size || sha != self.blob.sha256 {
                return Err(self.corrupt(format!(
                    "read {} bytes with sha256 {sha}, but it is {} bytes with sha256 {}",
                    self.read, self.blob.size, self.blob.sha256
                )));
            }
            return Ok(None);
        }
        self.read += bytes.len() as i64;
        if self.read > self.blob.size {
            self.done = true;
            return Err(self.corrupt(format!("more than its {} bytes are stored", self.blob.size)));
        }
        let Some(mut h) = self.hasher.take() else {
            return Ok(Some(bytes));
        };
        let (h, bytes) = blocking(move || {
            h.update(&bytes);
            Ok((h, bytes))
        })
        .await
        .map_err(|e| self.corrupt(e.to_string()))?;
        self.hasher = Some(h);
        Ok(Some(bytes))
    }
}

/// The `.part` file of an upload into the directory store: removed when
/// dropped still armed (the upload failed, or was abandoned midway by an
/// attempt stopped at a worker's stop).
struct PartFile(Option<PathBuf>);

impl Drop for PartFile {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, SystemTime};

    /// An upload's `.part` file goes with an upload that does not finish
    /// (its future dropped midway, as at a worker's stop), and stays once
    /// it became the blob (disarmed).
    #[test]
    fn a_part_file_is_removed_unless_the_upload_finished() {
        let dir = tempfile::tempdir().expect("dir");
        let abandoned = dir.path().join(".a.part");
        let kept = dir.path().join(".b.part");
        std::fs::write(&abandoned, b"half").expect("write");
        std::fs::write(&kept, b"whole").expect("write");
        drop(PartFile(Some(abandoned.clone())));
        let mut done = PartFile(Some(kept.clone()));
        done.0 = None;
        drop(done);
        assert!(
            !abandoned.exists(),
            "an abandoned upload's part file is removed"
        );
        assert!(kept.exists(), "a finished upload's file is not touched");
    }

    #[test]
    fn a_removed_blobs_file_is_deleted_when_it_predates_the_removal_or_nobody_claims_it() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let ago = |s: u64| now - Duration::from_secs(s);
        // (modified, removed_at, fate)
        let table = [
            // written long before the removal: the removed blob's own file
            (ago(7_200), ago(10), FileFate::Delete),
            (ago(70), ago(5), FileFate::Delete),
            // written within the margin of the removal, or after it: kept
            // while a re-upload's row may be on its way…
            (ago(40), ago(5), FileFate::Wait),
            (ago(2), ago(5), FileFate::Wait),
            (
                ago(ORPHAN_FILE_AGE.as_secs()),
                ago(ORPHAN_FILE_AGE.as_secs() - 10),
                FileFate::Wait,
            ),
            // …and deleted once nobody claimed it for ORPHAN_FILE_AGE
            (
                ago(ORPHAN_FILE_AGE.as_secs() + 1),
                ago(ORPHAN_FILE_AGE.as_secs() - 30),
                FileFate::Delete,
            ),
            // a clock ahead of ours (a file "from the future") waits
            (now + Duration::from_secs(30), ago(5), FileFate::Wait),
        ];
        for (modified, removed_at, want) in table {
            assert_eq!(
                file_fate(modified, removed_at, now),
                want,
                "modified {modified:?}, removed {removed_at:?}"
            );
        }
    }
}
