//! The artifact store's SQL (migrations/20261203000003_artifact_store.sql):
//! blob rows, their chunks, and reading both back one chunk per round trip.
//! On the pool every statement here is its own short transaction: no
//! transaction is held while a GiB streams (`crate::artifacts` drives the
//! loop). A caller may still compose them in a transaction of its own
//! through `DbConn` (see `mod.rs`).

use sqlx::Row;
use uuid::Uuid;

use super::{Ctx, Db, DbConn, DbError, InputArtifact, Scope};

/// Where a blob's bytes are, as its row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlobPlace {
    /// One bytea in the blob row (rows from before the chunked store, and
    /// blobs that fit in one chunk).
    Inline,
    /// `chunks` rows of `durable.artifact_chunks` under `upload_id`.
    Chunks { upload_id: Uuid, chunks: i32 },
    /// The file `<artifact_dir>/<sha[0..2]>/<sha>` of a shared directory.
    Directory,
}

/// A stored blob: its digest, size and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobRef {
    pub sha256: String,
    pub size: i64,
    pub place: BlobPlace,
}

/// How a blob row came out of [`Db::record_chunked_blob`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// This upload's chunks are the blob now.
    Ours,
    /// The blob existed already (another upload of the same bytes won): the
    /// caller's chunks are not referenced and must be deleted.
    Existing,
}

/// The `SELECT` list that [`blob_ref`] reads (table alias `b`).
pub(crate) const BLOB_COLUMNS: &str =
    "b.sha256 AS blob_sha256, b.size AS blob_size, b.store AS blob_store, b.upload_id AS blob_upload_id, b.chunks AS blob_chunks";

pub(crate) fn blob_ref(r: &sqlx::postgres::PgRow) -> Result<BlobRef, DbError> {
    let sha256: String = r.get("blob_sha256");
    let store: String = r.get("blob_store");
    let place = match store.as_str() {
        "inline" => BlobPlace::Inline,
        "directory" => BlobPlace::Directory,
        "chunks" => {
            let upload_id: Option<Uuid> = r.get("blob_upload_id");
            let chunks: Option<i32> = r.get("blob_chunks");
            match (upload_id, chunks) {
                (Some(upload_id), Some(chunks)) => BlobPlace::Chunks { upload_id, chunks },
                _ => {
                    return Err(DbError::Corrupt(format!(
                        "blob {sha256}: stored in chunks without an upload id or chunk count"
                    )))
                }
            }
        }
        other => {
            return Err(DbError::Corrupt(format!(
                "blob {sha256}: unknown store {other:?} (a newer supervisor wrote it: upgrade this one)"
            )))
        }
    };
    Ok(BlobRef {
        sha256,
        size: r.get("blob_size"),
        place,
    })
}

impl Db {
    /// Pins the bytes `sha256` for the attempt holding `lease`, before it
    /// uploads or claims them: while that lease is live, retention and the
    /// garbage pass leave the blob alone, whoever else referenced it
    /// (migration 20261227000001). The pin needs no release: once its
    /// attempt ended it protects nothing, and a retention pass prunes it
    /// ([`Db::prune_blob_pins`]).
    pub async fn pin_blob(&self, sha256: &str, lease: &super::Lease) -> Result<(), DbError> {
        self.connection("pinning an artifact blob")
            .await?
            .conn()
            .pin_blob(sha256, lease)
            .await
    }

    /// Claims the blob `sha256` if it is stored (refreshing `claimed_at`, so
    /// garbage collection leaves it alone until the commit references it);
    /// its size, or `None` when no such blob exists.
    pub async fn claim_blob(&self, sha256: &str) -> Result<Option<i64>, DbError> {
        self.connection("claiming an artifact blob")
            .await?
            .conn()
            .claim_blob(sha256)
            .await
    }

    /// Stores a blob that fits in one chunk as one value (inline). An
    /// existing blob of that sha256 is claimed instead.
    pub async fn record_inline_blob(&self, sha256: &str, content: &[u8]) -> Result<(), DbError> {
        self.connection("storing an artifact blob")
            .await?
            .conn()
            .record_inline_blob(sha256, content)
            .await
    }

    /// Writes chunk `n` of upload `upload_id` (its own statement: staged, not
    /// yet part of any blob).
    pub async fn put_chunk(&self, upload_id: Uuid, n: i32, data: &[u8]) -> Result<(), DbError> {
        self.connection("storing an artifact chunk")
            .await?
            .conn()
            .put_chunk(upload_id, n, data)
            .await
    }

    /// Promotes the verified chunks of `upload_id` to the blob `sha256`.
    /// `Existing` when that blob was recorded first by someone else (then
    /// claimed; the caller deletes its own chunks).
    pub async fn record_chunked_blob(
        &self,
        sha256: &str,
        size: i64,
        upload_id: Uuid,
        chunks: i32,
    ) -> Result<Recorded, DbError> {
        self.connection("storing an artifact blob")
            .await?
            .conn()
            .record_chunked_blob(sha256, size, upload_id, chunks)
            .await
    }

    /// Records a blob whose file is in the shared directory (or claims the
    /// existing blob of that sha256).
    pub async fn record_directory_blob(&self, sha256: &str, size: i64) -> Result<(), DbError> {
        self.connection("storing an artifact blob")
            .await?
            .conn()
            .record_directory_blob(sha256, size)
            .await
    }

    /// Deletes the chunks of an upload that did not become (or did not need
    /// to become) a blob. Never touches a promoted upload's chunks.
    pub async fn drop_upload(&self, upload_id: Uuid) -> Result<u64, DbError> {
        self.connection("deleting an unfinished upload")
            .await?
            .conn()
            .drop_upload(upload_id)
            .await
    }

    /// Chunk `n` of a chunked blob; `None` when it is missing.
    pub async fn blob_chunk(&self, upload_id: Uuid, n: i32) -> Result<Option<Vec<u8>>, DbError> {
        self.connection("reading an artifact chunk")
            .await?
            .conn()
            .blob_chunk(upload_id, n)
            .await
    }

    /// `len` bytes from `offset` of an inline blob (one `substring`); `None`
    /// when the blob is gone.
    pub async fn inline_slice(
        &self,
        sha256: &str,
        offset: i64,
        len: i64,
    ) -> Result<Option<Vec<u8>>, DbError> {
        self.connection("reading an artifact's bytes")
            .await?
            .conn()
            .inline_slice(sha256, offset, len)
            .await
    }

    /// The artifacts a step receives as input: those of its dependencies, in
    /// `depends_on` order.
    pub async fn input_artifacts(
        &self,
        run_id: Uuid,
        step_name: &str,
    ) -> Result<Vec<InputArtifact>, DbError> {
        self.connection("reading input artifacts")
            .await?
            .conn()
            .input_artifacts(run_id, step_name)
            .await
    }
}

impl DbConn<'_> {
    /// See [`Db::pin_blob`].
    pub async fn pin_blob(&mut self, sha256: &str, lease: &super::Lease) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query(
            "INSERT INTO durable.blob_pins (sha256, step_run_id, lease_token) VALUES ($1, $2, $3)
             ON CONFLICT DO NOTHING",
        )
        .bind(sha256)
        .bind(lease.step_run_id())
        .bind(lease.token())
        .execute(&mut *s)
        .await
        .ctx("pinning an artifact blob")?;
        s.done().await
    }

    /// See [`Db::claim_blob`].
    pub async fn claim_blob(&mut self, sha256: &str) -> Result<Option<i64>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let size = sqlx::query_scalar(
            "UPDATE durable.artifact_blobs SET claimed_at = now() WHERE sha256 = $1 RETURNING size",
        )
        .bind(sha256)
        .fetch_optional(&mut *s)
        .await
        .ctx("claiming an artifact blob")?;
        s.done().await?;
        Ok(size)
    }

    /// See [`Db::record_inline_blob`].
    pub async fn record_inline_blob(
        &mut self,
        sha256: &str,
        content: &[u8],
    ) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query(
            "INSERT INTO durable.artifact_blobs (sha256, size, content, store)
             VALUES ($1, $2, $3, 'inline')
             ON CONFLICT (sha256) DO UPDATE SET claimed_at = now()",
        )
        .bind(sha256)
        .bind(content.len() as i64)
        .bind(content)
        .execute(&mut *s)
        .await
        .ctx("storing an artifact blob")?;
        s.done().await
    }

    /// See [`Db::put_chunk`].
    pub async fn put_chunk(&mut self, upload_id: Uuid, n: i32, data: &[u8]) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query("INSERT INTO durable.artifact_chunks (upload_id, n, data) VALUES ($1, $2, $3)")
            .bind(upload_id)
            .bind(n)
            .bind(data)
            .execute(&mut *s)
            .await
            .ctx("storing an artifact chunk")?;
        s.done().await
    }

    /// See [`Db::record_chunked_blob`].
    pub async fn record_chunked_blob(
        &mut self,
        sha256: &str,
        size: i64,
        upload_id: Uuid,
        chunks: i32,
    ) -> Result<Recorded, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let ours: bool = sqlx::query_scalar(
            "INSERT INTO durable.artifact_blobs (sha256, size, store, upload_id, chunks)
             VALUES ($1, $2, 'chunks', $3, $4)
             ON CONFLICT (sha256) DO UPDATE SET claimed_at = now()
             RETURNING upload_id IS NOT DISTINCT FROM $3",
        )
        .bind(sha256)
        .bind(size)
        .bind(upload_id)
        .bind(chunks)
        .fetch_one(&mut *s)
        .await
        .ctx("storing an artifact blob")?;
        s.done().await?;
        Ok(if ours {
            Recorded::Ours
        } else {
            Recorded::Existing
        })
    }

    /// See [`Db::record_directory_blob`].
    pub async fn record_directory_blob(&mut self, sha256: &str, size: i64) -> Result<(), DbError> {
        let mut s = Scope::enter(self.conn).await?;
        sqlx::query(
            "INSERT INTO durable.artifact_blobs (sha256, size, store)
             VALUES ($1, $2, 'directory')
             ON CONFLICT (sha256) DO UPDATE SET claimed_at = now()",
        )
        .bind(sha256)
        .bind(size)
        .execute(&mut *s)
        .await
        .ctx("storing an artifact blob")?;
        s.done().await
    }

    /// See [`Db::drop_upload`].
    pub async fn drop_upload(&mut self, upload_id: Uuid) -> Result<u64, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let r = sqlx::query(
            "DELETE FROM durable.artifact_chunks c WHERE c.upload_id = $1
               AND NOT EXISTS (SELECT 1 FROM durable.artifact_blobs b WHERE b.upload_id = $1)",
        )
        .bind(upload_id)
        .execute(&mut *s)
        .await
        .ctx("deleting an unfinished upload")?;
        s.done().await?;
        Ok(r.rows_affected())
    }

    /// See [`Db::blob_chunk`].
    pub async fn blob_chunk(
        &mut self,
        upload_id: Uuid,
        n: i32,
    ) -> Result<Option<Vec<u8>>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let data = sqlx::query_scalar(
            "SELECT data FROM durable.artifact_chunks WHERE upload_id = $1 AND n = $2",
        )
        .bind(upload_id)
        .bind(n)
        .fetch_optional(&mut *s)
        .await
        .ctx("reading an artifact chunk")?;
        s.done().await?;
        Ok(data)
    }

    /// See [`Db::inline_slice`].
    pub async fn inline_slice(
        &mut self,
        sha256: &str,
        offset: i64,
        len: i64,
    ) -> Result<Option<Vec<u8>>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        // a bytea stops below 1 GiB: the offsets fit an integer
        let bytes = sqlx::query_scalar(
            "SELECT substring(content FROM ($2::bigint)::int FOR ($3::bigint)::int)
               FROM durable.artifact_blobs WHERE sha256 = $1 AND content IS NOT NULL",
        )
        .bind(sha256)
        .bind(offset + 1) // substring counts from 1
        .bind(len)
        .fetch_optional(&mut *s)
        .await
        .ctx("reading an artifact's bytes")?;
        s.done().await?;
        Ok(bytes)
    }

    /// See [`Db::input_artifacts`].
    pub async fn input_artifacts(
        &mut self,
        run_id: Uuid,
        step_name: &str,
    ) -> Result<Vec<InputArtifact>, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        let rows = sqlx::query(&format!(
            "SELECT a.id, a.name, a.sha256, a.size, a.media_type, s.name AS step_name, {}
               FROM durable.step_defs d
               JOIN durable.step_runs s ON s.run_id = d.run_id AND s.name = ANY (d.depends_on)
               JOIN durable.artifacts a ON a.step_run_id = s.id
               JOIN durable.artifact_blobs b ON b.sha256 = a.sha256
              WHERE d.run_id = $1 AND d.name = $2
              ORDER BY array_position(d.depends_on, s.name), a.name",
            BLOB_COLUMNS
        ))
        .bind(run_id)
        .bind(step_name)
        .fetch_all(&mut *s)
        .await
        .ctx("reading input artifacts")?;
        s.done().await?;
        rows.iter()
            .map(|r| {
                Ok(InputArtifact {
                    id: r.get("id"),
                    name: r.get("name"),
                    sha256: r.get("sha256"),
                    size: r.get("size"),
                    media_type: r.get("media_type"),
                    step_name: r.get("step_name"),
                    blob: blob_ref(r)?,
                })
            })
            .collect()
    }
}
