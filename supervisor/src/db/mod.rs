//! The only module that holds SQL.
//!
//! Every write a worker makes is fenced by its lease token
//! (`WHERE id = $1 AND lease_token = $2 AND state IN ('leased', 'running')`):
//! zero rows means the lease is lost, and the caller discards its outcome
//! (`DbError::LeaseLost`) instead of retrying the write. Only [`Db::lease`]
//! produces a [`Lease`], and only a `Lease` can complete, fail or cancel a step
//! (typestate, as in underway). Transactions are short: none is held while a
//! child runs. Times for leases come from the database clock (`now()`).
//!
//! # Composing operations in one transaction
//!
//! Every operation exists twice: as a method of [`Db`] (runs on the pool,
//! exactly as it always has) and as a method of [`DbConn`], a handle bound to
//! one connection the caller holds. Each `Db` method is a thin wrapper: it
//! takes a connection from the pool and calls the `DbConn` method on it. To
//! make several operations atomic, run them on the connection of one
//! transaction:
//!
//! ```ignore
//! let mut tx = db.begin().await?;           // BEGIN
//! let run = tx.conn().submit(&spec).await?;
//! tx.conn().cancel(run, None).await?;
//! tx.commit().await?;                       // or drop it / rollback(): nothing happened
//!
//! // the same, committed when the closure returns Ok, rolled back otherwise
//! let run = db.transaction(async |c| {
//!     let run = c.submit(&spec).await?;
//!     c.cancel(run, None).await?;
//!     Ok::<_, DbError>(run)
//! }).await?;
//! ```
//!
//! A caller that holds an `sqlx` transaction or connection of its own uses
//! `DbConn::new(&mut tx)`.
//!
//! Inside a caller's transaction every operation is atomic on its own: it
//! runs in a SAVEPOINT (operations that begin a transaction of their own
//! today, such as the fenced step writes, `write_batch`, `write_ledger`, the
//! reclaim, do exactly that through `conn.begin()`, which sqlx turns into a
//! SAVEPOINT inside a transaction; single statements get one too). An
//! operation that fails (`LeaseLost`, a write the database refused, a
//! timeout) rolls back to its savepoint: its own work is undone and the
//! caller's transaction stays usable, so the caller can go on and commit the
//! rest. On a connection that is not in a transaction no savepoint is made:
//! the statements are those the `Db` methods always sent.
//!
//! What inside a caller's transaction means for some operations:
//! - `watch_snapshot` and `artifact_lineage` set REPEATABLE READ, READ ONLY
//!   only when they begin the transaction themselves; inside a caller's
//!   transaction they read with the caller's isolation (and see its
//!   uncommitted writes): begin it REPEATABLE READ for one snapshot.
//! - `retention_batch` takes its advisory lock for the caller's transaction
//!   (other batches wait until it ends); its 5 s `lock_timeout` is restored
//!   to the caller's value before it returns.
//! - `reclaim_expired` reclaims every candidate in the caller's transaction
//!   (each in its own savepoint, the whole call in one): the locks are held
//!   until the caller commits.
//!
//! Pool-only (no `DbConn` form), and why:
//! - [`Db::listener`]: LISTEN needs a dedicated connection of its own that
//!   outlives any transaction (notifications are delivered between them).
//! - [`Db::migrate`]: the migrator takes its own advisory lock and runs each
//!   migration in a transaction of its own (some cannot run in one at all),
//!   and it changes the connection's `search_path` while it works.
//! - [`Db::retention_vacuum`] and [`Db::retention_pass`]: VACUUM cannot run
//!   inside a transaction block, and a pass is by design a series of short
//!   batch transactions (one transaction would hold every lock of the pass).
//!   Compose [`DbConn::retention_batch`] instead.
//! - [`Db::connect`], [`Db::connect_explained`], [`Db::dedicated`]: they make
//!   pools, they run no statement of the runtime.

mod blobs;
mod inspect;
mod ledger;
mod observe;
mod queue;
mod retention;
mod runs;
mod writes;

pub use blobs::{BlobPlace, BlobRef, Recorded};
pub use inspect::{
    its_steps_are, ArtifactInfo, ConnectError, EventRow, Lineage, Progress, RunFilter, RunSummary,
    StepHop, WatchRun, WatchStep,
};
pub use ledger::{
    Batch, BatchOutcome, CancelWrite, CheckpointEvent, CheckpointWrite, CompleteStoredWrite,
    CompleteWrite, EventsWrite, FailWrite, GiveBackWrite, LedgerOutcome, LedgerWrite, OwnedEvent,
    RefuseWrite, ReleaseWrite, RowOutcome, StartWrite, Written,
};
pub use observe::QueueDepth;
pub use retention::{
    RetentionBatch, RetentionOptions, RetentionPreview, RetentionReport, BLOB_GARBAGE_AGE,
    RETENTION_TABLES,
};
pub use runs::{PausedBy, PausedStep, StuckStep, SubmitOutcome, Submitted, WorkFor};
use writes::{begin_step_write_unless_held, insert_ending_event, write_failure};

use std::collections::BTreeMap;
use std::time::Duration as StdDuration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Executor, PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::retry::RetryPolicy;
use crate::state::{self, Failure, FailureDecision, RunState, StepFacts};

/// NOTIFY channel: a step became leasable (payload: executor_kind).
pub const CHANNEL_STEPS: &str = "durable_steps";
/// NOTIFY channel: cancellation was requested (payload: run id). A hint only:
/// the heartbeat is the path that always sees a cancel.
pub const CHANNEL_CANCEL: &str = "durable_cancel";

/// The migrations this binary carries. A schema with newer ones (applied by a
/// newer binary in a rolling upgrade) is not an error: they are additive, so
/// this binary runs on it and has nothing to apply.
static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate::Migrator {
    ignore_missing: true,
    ..sqlx::migrate!("../migrations")
};

/// The database's words when a migration failed for want of a privilege
/// (SQLSTATE 42501).
fn permission_denied(e: &sqlx::migrate::MigrateError) -> Option<String> {
    use sqlx::migrate::MigrateError;
    let (MigrateError::Execute(sqlx::Error::Database(db))
    | MigrateError::ExecuteMigration(sqlx::Error::Database(db), _)) = e
    else {
        return None;
    };
    (db.code().as_deref() == Some("42501")).then(|| db.message().to_owned())
}

/// A read of the migrations' bookkeeping table that failed: a lock another
/// session holds on it is said with what to do (audit 99: the checks went
/// on silently, and sqlx's own read waited out the lock again); the table
/// missing, or any other error, leaves the decision to sqlx's migrator.
fn bookkeeping_unreadable<T>(e: sqlx::Error) -> Result<Option<T>, DbError> {
    match &e {
        sqlx::Error::Database(db)
            if matches!(db.code().as_deref(), Some("55P03") | Some("57014")) =>
        {
            Err(DbError::MigrationAdvice(locked_advice(
                "reading the migrations' bookkeeping table durable._sqlx_migrations",
                db.message(),
            )))
        }
        _ => Ok(None),
    }
}

/// What to do when a migration waited too long for a lock.
fn locked_advice(what: &str, server_says: &str) -> String {
    format!(
        "{what} waited too long for a lock another session holds ({server_says}): nothing of it \
         was applied, and the migrations before it are. Run `supervisor migrate` again once that \
         session is done (a long transaction, a LOCK TABLE: see pg_stat_activity); it is safe to \
         run again, also while workers run"
    )
}

/// What a failed migration means and what to do, where sqlx's own words
/// do not say (audit 98: "partially applied; fix and remove row from
/// `_sqlx_migrations` table", a bare lock timeout, "previously applied but
/// has been modified").
fn migrate_advice(e: &sqlx::migrate::MigrateError) -> Option<String> {
    use sqlx::migrate::MigrateError;
    match e {
        MigrateError::Dirty(v) => Some(format!(
            "migration {v} is marked as failed in durable._sqlx_migrations (success is false): \
             a migration applies whole or not at all, so the row was left or changed by hand. \
             If the schema has that migration's changes, mark it done (UPDATE \
             durable._sqlx_migrations SET success = true WHERE version = {v}); if it has none \
             of them, remove the row (DELETE FROM durable._sqlx_migrations WHERE version = {v}); \
             then run `supervisor migrate` again"
        )),
        MigrateError::VersionMismatch(v) => Some(format!(
            "migration {v} as applied to the database differs from this binary's (its checksum): \
             the schema was migrated by a build with another text of that migration. Use the \
             binary that migrated it, or a release whose migrations match; an applied migration \
             is never edited"
        )),
        MigrateError::ExecuteMigration(sqlx::Error::Database(db), v)
            if matches!(db.code().as_deref(), Some("55P03") | Some("57014")) =>
        {
            Some(locked_advice(
                &format!("migration {v} (on a table it changes)"),
                db.message(),
            ))
        }
        MigrateError::Execute(sqlx::Error::Database(db))
            if matches!(db.code().as_deref(), Some("55P03") | Some("57014")) =>
        {
            Some(locked_advice(
                "reading the migrations applied",
                db.message(),
            ))
        }
        _ => None,
    }
}

/// The `application_name` of this process's sessions ([`name_sessions`]).
static APPLICATION_NAME: std::sync::RwLock<Option<String>> = std::sync::RwLock::new(None);

/// Names the database sessions this process opens from now on
/// (`application_name`, as `pg_stat_activity` shows it): `durable worker w1`,
/// `durable status`. A URL's own `application_name` (or PGAPPNAME) wins.
pub fn name_sessions(name: &str) {
    // PostgreSQL keeps 63 bytes of it, printable ASCII
    let name: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_graphic() || c == ' ' {
                c
            } else {
                '?'
            }
        })
        .take(63)
        .collect();
    *APPLICATION_NAME
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(name);
}

fn application_name() -> Option<String> {
    APPLICATION_NAME
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// The first migration's first statement (see `Db::migrator_for_existing_schema`).
const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS durable;";

/// Session advisory lock held while `migrate` creates the schema and applies
/// the migrations: `CREATE SCHEMA IF NOT EXISTS` is not race-free (two
/// processes at once can both try to create it, and one fails on
/// pg_namespace's unique index), and sqlx's own lock is only taken after it.
const MIGRATE_LOCK: i64 = 0x6475_7261_626c_6531; // "durable1"

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot connect to PostgreSQL at {url}: {source}. Is the server running and DATABASE_URL right?")]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("database error while {context}: {source}")]
    Query {
        context: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A migration that failed for a reason the operator can act on, said
    /// with what to do.
    #[error("migration failed: {0}")]
    MigrationAdvice(String),
    #[error("invalid spec: {0}")]
    InvalidSpec(String),
    #[error("{0}")]
    NotFound(String),
    /// A submit whose idempotency key names a run retention is removing:
    /// the key is free again once the run is gone.
    #[error("{0}")]
    KeyBeingFreed(String),
    #[error("the lease on step {step_run_id} is lost (another owner, expired, or the step moved on); the outcome is discarded")]
    LeaseLost { step_run_id: Uuid },
    /// The database refused one row of a batch (its own subtransaction).
    #[error("the database refused this write ({sqlstate}): {message}")]
    Refused { sqlstate: String, message: String },
    /// A write that could not be done now and may be tried again (the
    /// worker's ledger stopped, or a batch failed as a whole).
    #[error("{context}; the write is retried while the lease allows")]
    Retry { context: &'static str },
    #[error("corrupt row: {0}")]
    Corrupt(String),
    #[error("the database did not answer within {ms} ms while {context}")]
    Timeout { context: &'static str, ms: u64 },
    #[error("the database schema is at version {have}; this binary needs at least {need}. Run `supervisor migrate` with a binary at least this new, then run this command again")]
    SchemaTooOld { have: i64, need: i64 },
    #[error("the database has no durable schema (no migrations applied). Run `supervisor migrate` first")]
    SchemaMissing,
    #[error("migration {version} of the database schema is marked as failed (durable._sqlx_migrations.success is false): no binary runs on a schema so marked. {fix}")]
    SchemaFailed { version: i64, fix: &'static str },
    /// The connecting role lacks privileges the command needs (what to grant).
    #[error("missing privileges: {0}")]
    Privileges(String),
}

impl DbError {
    /// A finished run retention has taken part of (it goes over several
    /// batches): it reads as gone, not as the half of it that is left.
    pub fn being_removed(run_id: Uuid) -> DbError {
        DbError::NotFound(format!(
            "run {run_id} is being removed by retention (it finished before the cutoff and part \
             of it is gone already): it can no longer be read; `supervisor gc` or a worker's \
             retention removes the rest"
        ))
    }

    /// The call's own time ran out ([`bounded`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, DbError::Timeout { .. })
    }

    /// A pool's error: it could not open a connection in time.
    pub fn is_pool_timeout(&self) -> bool {
        matches!(
            self,
            DbError::Query {
                source: sqlx::Error::PoolTimedOut,
                ..
            } | DbError::Connect {
                source: sqlx::Error::PoolTimedOut,
                ..
            }
        )
    }

    /// The server answered the statement with an error: it did not run (a
    /// refused privilege, a lock timeout, a constraint), unlike a call cut
    /// off or a connection lost on the way, whose statement may have run.
    pub fn answered_by_the_server(&self) -> bool {
        matches!(
            self,
            DbError::Query {
                source: sqlx::Error::Database(_),
                ..
            }
        )
    }

    /// The SQLSTATE of a database error, if this is one.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            DbError::Query {
                source: sqlx::Error::Database(d),
                ..
            } => d.code().map(|c| c.into_owned()),
            DbError::Refused { sqlstate, .. } => Some(sqlstate.clone()),
            _ => None,
        }
    }

    /// Whether trying the same write again can succeed: lost connections,
    /// timeouts, a server restarting, serialization failures and deadlocks,
    /// lock timeouts, exhausted resources. Everything else (data exceptions,
    /// constraint violations, program limits such as a message too large, our
    /// own raised errors) fails the same way every time: permanent.
    pub fn is_transient(&self) -> bool {
        match self {
            DbError::Connect { source, .. } | DbError::Query { source, .. } => {
                sqlx_is_transient(source)
            }
            DbError::Timeout { .. } | DbError::Retry { .. } => true,
            DbError::Refused { sqlstate, .. } => sqlstate_is_transient(sqlstate),
            _ => false,
        }
    }
}

impl DbError {
    /// Whether the connection the call used is gone (a restarted server,
    /// `pg_terminate_backend`, a network break): a new one may well work at
    /// once, unlike a lock, a timeout or a refusal.
    pub fn connection_ended(&self) -> bool {
        match self {
            DbError::Query { source, .. } | DbError::Connect { source, .. } => match source {
                sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => true,
                sqlx::Error::Database(d) => d
                    .code()
                    .is_some_and(|c| c.starts_with("08") || c.starts_with("57P0")),
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether the connection broke while a statement was on its way: the
    /// database may have committed it before the break (a submit's run may
    /// exist).
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            DbError::Query {
                source: sqlx::Error::Io(_) | sqlx::Error::Protocol(_),
                ..
            }
        )
    }
}

fn sqlx_is_transient(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|c| sqlstate_is_transient(&c)),
        _ => false,
    }
}

/// SQLSTATE classes worth a retry: 08 connection, 40 transaction rollback
/// (serialization, deadlock), 53 insufficient resources, 57 operator
/// intervention (admin shutdown, statement timeout), 58 system error, and
/// 55P03 lock_not_available (lock_timeout), 55006 object in use.
pub fn sqlstate_is_transient(code: &str) -> bool {
    ["08", "40", "53", "57", "58"]
        .iter()
        .any(|c| code.starts_with(c))
        || code == "55P03"
        || code == "55006"
}

/// Runs a database call with a bound: no call may wait forever (a blackholed
/// network must not stall the worker past its lease).
pub async fn bounded<T>(
    limit: StdDuration,
    context: &'static str,
    fut: impl std::future::Future<Output = Result<T, DbError>>,
) -> Result<T, DbError> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(DbError::Timeout {
            context,
            ms: limit.as_millis() as u64,
        }),
    }
}

trait Ctx<T> {
    fn ctx(self, context: &'static str) -> Result<T, DbError>;
}

impl<T> Ctx<T> for Result<T, sqlx::Error> {
    fn ctx(self, context: &'static str) -> Result<T, DbError> {
        self.map_err(|source| DbError::Query { context, source })
    }
}

/// How long a pooled connection may sit idle before it is closed.
const POOL_IDLE: StdDuration = StdDuration::from_secs(30);
/// How long a pooled connection lives at most (closed when given back
/// after it, or while idle).
const POOL_LIFETIME: StdDuration = StdDuration::from_secs(60);

/// When a BEGIN was last cut off before its answer came (milliseconds since
/// the UNIX epoch; 0: never). sqlx's guard rolls back only a transaction
/// whose BEGIN was answered: a BEGIN cut off in flight (a call's time bound,
/// a stop) reaches the server anyway, which opens the transaction, and sqlx
/// gives the connection back to its pool as if none were open. Every later
/// statement of that connection then runs inside it and is never committed
/// (throughput-core audit: a worker logged outcomes as recorded that no other
/// session saw, and held their rows until it exited).
static BEGIN_CUT_OFF_AT_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// For this long after a BEGIN was cut off, every connection given back to a
/// pool is checked for a transaction left open (one round trip each; the
/// connection the BEGIN was sent on is given back at once).
const CUT_OFF_CHECK_WINDOW_MS: u64 = 5_000;

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `conn.begin()` (a transaction, or a savepoint inside one) that notes when
/// it is cut off before its answer: see [`BEGIN_CUT_OFF_AT_MS`]. Every
/// transaction of the runtime begins here.
pub(crate) async fn begin(
    conn: &mut PgConnection,
) -> Result<sqlx::Transaction<'_, sqlx::Postgres>, sqlx::Error> {
    let mut guard = BeginInFlight(true);
    let tx = conn.begin().await;
    guard.0 = false;
    tx
}

/// Armed while a BEGIN awaits its answer: dropped armed (the BEGIN cut
/// off), it notes the time in [`BEGIN_CUT_OFF_AT_MS`].
struct BeginInFlight(bool);

impl Drop for BeginInFlight {
    fn drop(&mut self) {
        if self.0 {
            BEGIN_CUT_OFF_AT_MS.store(unix_ms(), std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// The pools' check of a connection given back (`after_release`): its
/// buffers shrunk back to their default size; and within
/// [`CUT_OFF_CHECK_WINDOW_MS`] of a BEGIN cut off, a connection inside a
/// transaction no caller holds is closed (the server rolls it back) instead
/// of being handed out again. In a transaction block `now()` is when it
/// began, earlier than the statement's own start; outside one the two are
/// the same instant.
fn close_if_left_in_a_transaction(
    conn: &mut PgConnection,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<bool, sqlx::Error>> + Send + '_>> {
    // a batch of large outputs (or a lease of large inputs) grew this
    // connection's buffers to its size, kept for as long as it lives, per
    // connection: given back here (cheap when they are small already)
    conn.shrink_buffers();
    Box::pin(async move {
        let cut = BEGIN_CUT_OFF_AT_MS.load(std::sync::atomic::Ordering::SeqCst);
        if cut == 0 || unix_ms().saturating_sub(cut) > CUT_OFF_CHECK_WINDOW_MS {
            return Ok(true);
        }
        // no parameters: the simple protocol, where the statement's own
        // transaction (if none is open) starts at the statement's start
        let row = conn
            .fetch_one("SELECT now() = statement_timestamp()")
            .await?;
        let clean: bool = row.try_get(0)?;
        if !clean {
            tracing::warn!(
                "a connection given back inside a transaction its caller no longer holds (a BEGIN cut \
                 off before its answer) is closed: the server rolls that transaction back"
            );
        }
        Ok(clean)
    })
}

/// A handle on the runtime's database.
#[derive(Clone, Debug)]
pub struct Db {
    pool: PgPool,
}

/// The runtime's database operations on one connection the caller holds:
/// a pooled connection, or the connection of a transaction (from
/// [`Db::begin`], [`Db::transaction`], or the caller's own `sqlx`
/// transaction: `DbConn::new(&mut tx)`). Inside a transaction each operation
/// runs in a savepoint of its own (see the module documentation).
#[derive(Debug)]
pub struct DbConn<'c> {
    conn: &'c mut PgConnection,
}

impl<'c> DbConn<'c> {
    pub fn new(conn: &'c mut PgConnection) -> DbConn<'c> {
        DbConn { conn }
    }
}

/// A transaction on the runtime's database (from [`Db::begin`]): run
/// operations on it with [`DbTransaction::conn`], then `commit`. Dropped
/// without a commit, it rolls back.
#[derive(Debug)]
pub struct DbTransaction {
    tx: sqlx::Transaction<'static, sqlx::Postgres>,
}

impl DbTransaction {
    /// The operations, on this transaction's connection.
    pub fn conn(&mut self) -> DbConn<'_> {
        DbConn::new(&mut self.tx)
    }

    pub async fn commit(self) -> Result<(), DbError> {
        self.tx.commit().await.ctx("committing a transaction")
    }

    pub async fn rollback(self) -> Result<(), DbError> {
        self.tx.rollback().await.ctx("rolling back a transaction")
    }
}

/// A connection of the pool: taken by one `Db` wrapper for one operation,
/// or kept by its owner across operations (from [`Db::connection`]; the
/// ledger's). The pool checks every connection given
/// back with a round trip (sqlx sends a Sync and waits for its
/// ReadyForQuery), so an owner that writes every few milliseconds keeps one
/// instead of taking and giving back one per write. Give it back (drop it)
/// after an error or a timeout: an operation cut off midway may leave
/// answers unread, which the pool's check on return then clears.
#[derive(Debug)]
pub struct DbConnection(sqlx::pool::PoolConnection<sqlx::Postgres>);

impl DbConnection {
    /// The operations, on this connection.
    pub fn conn(&mut self) -> DbConn<'_> {
        DbConn::new(&mut self.0)
    }
}

/// Where one operation of a [`DbConn`] runs: in a savepoint of its own when
/// the connection is in a caller's transaction (so its failure undoes only
/// its own work and leaves the caller's transaction usable), directly on the
/// connection otherwise (the statements the pool form always sent).
enum Scope<'a> {
    Savepoint(sqlx::Transaction<'a, sqlx::Postgres>),
    Bare(&'a mut PgConnection),
}

impl<'a> Scope<'a> {
    async fn enter(conn: &'a mut PgConnection) -> Result<Scope<'a>, DbError> {
        if conn.is_in_transaction() {
            Ok(Scope::Savepoint(
                begin(conn).await.ctx("opening a savepoint")?,
            ))
        } else {
            Ok(Scope::Bare(conn))
        }
    }

    /// The operation succeeded: release its savepoint, if it has one.
    async fn done(self) -> Result<(), DbError> {
        match self {
            Scope::Savepoint(tx) => tx.commit().await.ctx("releasing a savepoint"),
            Scope::Bare(_) => Ok(()),
        }
    }
}

impl std::ops::Deref for Scope<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        match self {
            Scope::Savepoint(tx) => tx,
            Scope::Bare(c) => c,
        }
    }
}

impl std::ops::DerefMut for Scope<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Scope::Savepoint(tx) => tx,
            Scope::Bare(c) => c,
        }
    }
}

/// A routing entry: this worker can run steps of `executor_kind` / `kind`
/// whose labels are all offered in `labels`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Route {
    pub executor_kind: String,
    pub kind: String,
    pub labels: BTreeMap<String, String>,
}

/// What a route of one executor takes of the steps that name secrets: the
/// steps whose secrets it may hand out (`mine`), and those that no other
/// executor both may hand out and offers the labels for (which it leases and
/// fails `SECRET_NOT_ALLOWED`, as an executor alone does). The others are
/// the worker's own (`others`, from its config) and the executors the other
/// live workers registered (read by the lease statement: live as `status`
/// counts a worker live; a worker that stops being so leaves its steps to
/// the rest, which fail them). Without it, whichever executor leased first
/// took a step, and one that may not hand out its secret failed it for good
/// while another could have run it (security audit within a worker, routing
/// audit across workers).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SecretFilter {
    pub mine: Vec<String>,
    pub others: Vec<OtherExecutor>,
}

/// Another executor serving a route: the labels it offers there and the
/// secrets it may hand out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OtherExecutor {
    pub labels: BTreeMap<String, String>,
    pub secrets: Vec<String>,
}

/// Proof of ownership of one step attempt. Only [`Db::lease`] creates one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    step_run_id: Uuid,
    token: Uuid,
    attempt: u32,
}

impl Lease {
    pub fn step_run_id(&self) -> Uuid {
        self.step_run_id
    }
    pub fn token(&self) -> Uuid {
        self.token
    }
    pub fn attempt(&self) -> u32 {
        self.attempt
    }
    /// A lease made up for a unit test of the worker's bookkeeping.
    #[cfg(test)]
    pub(crate) fn for_test(step_run_id: Uuid, token: Uuid, attempt: u32) -> Lease {
        Lease {
            step_run_id,
            token,
            attempt,
        }
    }
}

/// A step this worker now owns, with everything needed to run it.
#[derive(Debug, Clone)]
pub struct LeasedStep {
    pub lease: Lease,
    pub run_id: Uuid,
    pub name: String,
    pub executor_kind: String,
    pub kind: String,
    pub labels: BTreeMap<String, String>,
    pub input: serde_json::Value,
    pub idempotency_key: String,
    pub retry: RetryPolicy,
    pub timeout_ms: Option<i64>,
    pub heartbeat_timeout_ms: Option<i64>,
    pub deadline: Option<DateTime<Utc>>,
    pub secrets: Vec<String>,
    pub checkpoint: Option<Vec<u8>>,
    pub cancel_requested: bool,
    /// Whether the step's definition names dependencies (only then can it
    /// have input artifacts to fetch).
    pub has_dependencies: bool,
    /// The code of the step's last error or refusal, if any (an earlier
    /// attempt's: the lease leaves it). After `EXECUTOR_CRASHED` the attempt
    /// takes a process that served no job (see `worker::attempt`).
    pub last_error: Option<String>,
    /// Why `input` could not be decoded (it is `null` then): nested deeper
    /// than the JSON decoder takes, stored before submit refused that. The
    /// attempt fails the step (`INPUT_UNDECODABLE`) instead of the worker dying
    /// on the row, again at every lease.
    pub input_error: Option<String>,
}

/// What one batched heartbeat learned.
#[derive(Debug, Default)]
pub struct HeartbeatReport {
    /// Leases renewed whose step has a cancel request.
    pub cancel_requested: Vec<Uuid>,
    /// Leases this worker no longer holds.
    pub lost: Vec<Uuid>,
    /// Leases still held but locked by a write in flight: not renewed this time.
    pub busy: Vec<Uuid>,
    /// How long each busy lease's last committed renewal still holds, from
    /// the heartbeat's statement on (a checkpoint write renews its lease:
    /// a step whose row is held by its own checkpoints stays leased).
    pub busy_valid_for: std::collections::HashMap<Uuid, std::time::Duration>,
    /// Leases renewed by this heartbeat (valid until its send time + TTL).
    pub renewed_ids: Vec<Uuid>,
    pub renewed: usize,
}

/// A progress event, as persisted.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    pub sequence: u64,
    pub kind: &'a str,
    pub message: &'a str,
    pub fraction: Option<f64>,
    pub checkpoint: Option<&'a [u8]>,
    pub executor_at: Option<DateTime<Utc>>,
}

/// An artifact of a successful result whose blob is already stored (see
/// `crate::artifacts`): the commit references it by sha256 and size.
#[derive(Debug, Clone, PartialEq)]
pub struct NewArtifact {
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
    pub derived_from: Vec<Uuid>,
}

/// An input artifact for a step: the output of one of its dependencies.
#[derive(Debug, Clone)]
pub struct InputArtifact {
    pub id: Uuid,
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
    pub step_name: String,
    /// Where its bytes are (read them with `crate::artifacts::ArtifactStore`).
    pub blob: BlobRef,
}

/// A failure as the worker observed it, with the evidence to store.
#[derive(Debug, Clone)]
pub struct FailureReport {
    pub failure: Failure,
    pub message: String,
    pub details: Option<serde_json::Value>,
    pub sequence: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepError {
    pub code: String,
    pub message: String,
    pub retryable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<serde_json::Value>,
    /// The error is an earlier attempt's: the step is leased or running
    /// again (only then written, `true`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub earlier_attempt: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct ArtifactSummary {
    pub id: Uuid,
    pub name: String,
    pub sha256: String,
    pub size: i64,
    pub media_type: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct StepStatus {
    pub name: String,
    pub step_run_id: Uuid,
    pub state: String,
    /// Why a `terminal_failed` or `cancelled` step ended so (its last
    /// transition's reason): `ATTEMPT_TIMEOUT: the next attempt would start
    /// after the step deadline`, `RUN_FAILED`, `CANCEL_REQUESTED`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub attempt: i32,
    pub executor_kind: String,
    pub kind: String,
    pub idempotency_key: String,
    pub cancel_requested: bool,
    #[serde(
        serialize_with = "crate::json::utc_micros_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub next_attempt_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub output: Option<serde_json::Value>,
    /// `null` when the step has no error (always present, as in CONTRACT §4).
    pub error: Option<StepError>,
    pub events: i64,
    pub artifacts: Vec<ArtifactSummary>,
    /// The worker that holds the step's lease, or held its last one (its
    /// `name`); `null` before the first lease, or once that worker's row was
    /// removed (README "Many hosts": the owner by name).
    pub worker: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct WaitingStep {
    pub name: String,
    pub depends_on: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RunStatus {
    pub run_id: Uuid,
    pub name: String,
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    pub cancel_requested: bool,
    #[serde(serialize_with = "crate::json::utc_micros")]
    pub created_at: DateTime<Utc>,
    /// `null` while the run is open (as `runs --json` shows it).
    #[serde(serialize_with = "crate::json::utc_micros_opt")]
    pub finished_at: Option<DateTime<Utc>>,
    pub steps: Vec<StepStatus>,
    /// Steps not created yet: they wait for their dependencies to succeed.
    pub waiting: Vec<WaitingStep>,
}

/// The query parameters sqlx's PostgreSQL driver knows.
const KNOWN_URL_PARAMETERS: [&str; 18] = [
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
];

/// `url` with the value of every query parameter the driver does not know
/// replaced by `***`: a misspelt `pasword=` is a password all the same
/// (security audit: printed in an error while the log said its value
/// never is).
fn mask_unknown_url_parameters(url: &str) -> String {
    let Some((head, rest)) = url.split_once('?') else {
        return url.to_owned();
    };
    let (query, frag) = match rest.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (rest, None),
    };
    let query: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, _)) if !KNOWN_URL_PARAMETERS.contains(&k) => format!("{k}=***"),
            _ => p.to_owned(),
        })
        .collect();
    let mut out = format!("{head}?{}", query.join("&"));
    if let Some(f) = frag {
        out.push('#');
        out.push_str(f);
    }
    out
}

/// The query parameters of a connection URL that the driver ignores (it
/// logs them with their values, which the CLI's filter silences): every key
/// but those `PgConnectOptions` reads.
pub fn unknown_url_parameters(url: &str) -> Vec<String> {
    let Some((_, query)) = url.split_once('?') else {
        return Vec::new();
    };
    let query = query.split('#').next().unwrap_or_default();
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| p.split('=').next().unwrap_or_default())
        .filter(|k| !KNOWN_URL_PARAMETERS.contains(k))
        .map(|k| k.escape_debug().to_string())
        .collect()
}

fn parse_labels(v: serde_json::Value) -> Result<BTreeMap<String, String>, DbError> {
    serde_json::from_value(v).map_err(|e| DbError::Corrupt(format!("labels: {e}")))
}

/// What a `migrate` did: the schema's version after it, and how many
/// migrations this call applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    pub version: i64,
    pub applied: usize,
}

impl Db {
    /// Connects with a pool of `max_connections`.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Db, DbError> {
        for key in unknown_url_parameters(url) {
            tracing::warn!(
                parameter = %key,
                "the database URL's parameter is not one the driver knows, and is ignored (its value is not logged)"
            );
        }
        let opts: PgConnectOptions = url.parse().map_err(|source| DbError::Connect {
            url: redact_url(url),
            source,
        })?;
        // who this session is in pg_stat_activity, unless the URL or
        // PGAPPNAME says (audit of the operator's tools: every session of
        // every worker and command was nameless)
        let opts = match (opts.get_application_name(), application_name()) {
            (None, Some(name)) => opts.application_name(&name),
            _ => opts,
        };
        // No statement waits forever on a lock or runs away (a transient
        // error the callers retry); the heartbeat's own connection is tighter.
        // Every statement is planned once per connection (generic plans): by
        // default PostgreSQL re-plans a prepared statement with its values
        // whenever the generic plan looks costlier, which with arrays as
        // parameters is always: the lease cost 0.86 ms of planning per call,
        // the triggers' array statements 0.2–0.5 ms each. The runtime's SQL
        // is written for it (key probes whose plan does not depend on the
        // values; tests/tests/bounded_reads.rs). No JIT: a generic plan's
        // estimate over a million pending rows crosses jit_above_cost, and
        // compiling it cost 280 ms for a lease that runs in 0.1 ms.
        // A statement slower than 1 s is worth a line in a worker's log, not a
        // WARN on a command's terminal (a cancel that waited on a held row
        // printed one above its own error)
        let opts = opts
            .log_statements(tracing::log::LevelFilter::Trace)
            .log_slow_statements(tracing::log::LevelFilter::Info, StdDuration::from_secs(1))
            .options([
                ("statement_timeout", "60000"),
                ("lock_timeout", "10000"),
                // a session idle inside a transaction this long is a client
                // that froze (SIGSTOP, a paused VM) with rows locked: its
                // run could be neither reclaimed nor cancelled until it woke
                // (re-check audit). A worker lowers it to its lease TTL.
                ("idle_in_transaction_session_timeout", "60000"),
                ("plan_cache_mode", "force_generic_plan"),
                ("jit", "off"),
                // the runtime's SQL is written for READ COMMITTED (a row
                // locked by another transaction is re-checked on its new
                // version, not a serialization failure): a database or role
                // whose default is SERIALIZABLE failed ~40% of concurrent
                // submits with 40001 and made the ledger retry its batches
                // (the backslash keeps the blank: the options string is split on blanks)
                ("default_transaction_isolation", "read\\ committed"),
            ]);
        // No ping before every acquire (sqlx's default): it costs a round trip
        // per statement batch (~3 per step, measured by bench_queue); a dead
        // connection surfaces as an error on the next statement instead, which
        // every caller already handles (commit retries, the loops retry).
        // A connection lives at most POOL_LIFETIME (sqlx's default: 30
        // minutes), idle ones at most POOL_IDLE: a burst's connections kept
        // filled a small server's max_connections, so that no worker's
        // heartbeat could open its own and every worker stood still with
        // idle connections in hand (DB fault audit). The idle bound alone
        // never fired: the pool hands out its idle connections in turn, and
        // a worker's once-a-second loops touched each of them every few
        // seconds (re-check audit); one past its lifetime is closed and
        // opened again only if the pool needs it. A slow acquire is the
        // worker's own log's to tell (a timeout names what waited), not a
        // WARN of the library's per call.
        let pool = PgPoolOptions::new()
            .max_connections(max_connections)
            .test_before_acquire(false)
            .acquire_timeout(StdDuration::from_secs(10))
            .idle_timeout(POOL_IDLE)
            .max_lifetime(POOL_LIFETIME)
            .acquire_slow_level(tracing::log::LevelFilter::Debug)
            .after_release(|conn, _| close_if_left_in_a_transaction(conn))
            .connect_with(opts)
            .await
            .map_err(|source| DbError::Connect {
                url: redact_url(url),
                source,
            })?;
        Ok(Db { pool })
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The pool's connections end a transaction left idle for `limit`
    /// (PostgreSQL's idle_in_transaction_session_timeout): a worker frozen
    /// inside one holds its rows no longer than its leases last. The idle
    /// connections are closed, so that every connection opened from now on
    /// has it; one in use at this moment keeps [`Db::connect`]'s minute.
    pub async fn end_idle_transactions_after(&self, limit: StdDuration) {
        let ms = limit.as_millis().max(1).to_string();
        let opts = (*self.pool.connect_options())
            .clone()
            .options([("idle_in_transaction_session_timeout", ms.as_str())]);
        self.pool.set_connect_options(opts);
        for _ in 0..self.pool.num_idle() {
            match self.pool.try_acquire() {
                Some(c) => {
                    let _ = c.close().await;
                }
                None => break,
            }
        }
    }

    /// A `Db` over a pool the caller configured, without the session
    /// settings [`Db::connect`] gives the runtime's connections (the
    /// benchmarks' plain-SQL baselines use PostgreSQL's defaults).
    pub fn from_pool(pool: PgPool) -> Db {
        Db { pool }
    }

    /// A separate pool of one connection to the same database, with
    /// `statement_timeout` and `lock_timeout` of `timeout`: the heartbeat's
    /// own, so a busy pool never delays a renewal, and LISTEN's, which holds
    /// its connection for good. Connects lazily, so a database that is away
    /// at this moment is not an error here.
    pub fn dedicated(&self, timeout: StdDuration) -> Db {
        let ms = timeout.as_millis().max(1).to_string();
        let opts = (*self.pool.connect_options()).clone().options([
            ("statement_timeout", ms.as_str()),
            ("lock_timeout", ms.as_str()),
        ]);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .test_before_acquire(false)
            .acquire_timeout(timeout)
            .acquire_slow_level(tracing::log::LevelFilter::Debug)
            .after_release(|conn, _| close_if_left_in_a_transaction(conn))
            .connect_lazy_with(opts);
        Db { pool }
    }

    /// Why a new connection cannot be opened now, if it cannot: the
    /// server's own words (`sorry, too many clients already`, `connection
    /// refused`, a role's connection limit). A pool that cannot connect
    /// retries those until its timeout and then says only that it timed
    /// out, which reads like the worker's own `db_max_connections` (DB fault
    /// audit). One connection attempt, closed at once, bounded by `limit`.
    pub async fn connect_error(&self, limit: StdDuration) -> Option<String> {
        use sqlx::ConnectOptions;
        let opts = (*self.pool.connect_options()).clone();
        match tokio::time::timeout(limit, opts.connect()).await {
            Ok(Ok(c)) => {
                let _ = sqlx::Connection::close(c).await;
                None
            }
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!(
                "no answer to a new connection within {} ms",
                limit.as_millis()
            )),
        }
    }

    /// The server's reason behind `e`, where `e` is the pool's "timed out"
    /// (which says nothing of why): see [`Db::connect_error`]. `None` for
    /// any other error, whose own message already says what the server did.
    pub async fn server_reason(&self, e: &DbError, limit: StdDuration) -> Option<String> {
        if e.is_pool_timeout() {
            self.connect_error(limit).await
        } else {
            None
        }
    }

    /// What the connecting role lacks of what a worker needs: SELECT,
    /// INSERT, UPDATE and DELETE on every table of the runtime's schema (the
    /// migrations' bookkeeping: SELECT), USAGE on its sequences, EXECUTE on
    /// its functions (but the submitters' two); one `PRIVILEGE on
    /// durable.object` per missing grant.
    /// A worker without one of them ran, leased, and had every outcome
    /// refused: its steps stayed leased for good.
    pub async fn missing_worker_privileges(&self) -> Result<Vec<String>, DbError> {
        let mut conn = self.connection("checking the worker's privileges").await?;
        sqlx::query_scalar::<_, String>(
            "SELECT p.priv || ' on durable.' || c.relname
               FROM pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'durable'
               CROSS JOIN LATERAL unnest(CASE
                   WHEN c.relkind = 'S' THEN ARRAY['USAGE']
                   -- the owner's tables, which a worker only reads
                   WHEN c.relname IN ('_sqlx_migrations', 'step_transition_rules', 'run_transition_rules')
                       THEN ARRAY['SELECT']
                   ELSE ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE'] END) AS p(priv)
              WHERE c.relkind IN ('r', 'p', 'S')
                AND NOT CASE WHEN c.relkind = 'S' THEN has_sequence_privilege(c.oid, p.priv)
                             ELSE has_table_privilege(c.oid, p.priv) END
             UNION ALL
             SELECT 'EXECUTE on durable.' || f.proname || '()'
               FROM pg_proc f
               JOIN pg_namespace n ON n.oid = f.pronamespace AND n.nspname = 'durable'
              WHERE NOT has_function_privilege(f.oid, 'EXECUTE')
                -- the submitters' entry points: a worker calls neither
                AND f.proname NOT IN ('submit_run', 'cancel_run')
              ORDER BY 1",
        )
        .fetch_all(conn.conn().conn)
        .await
        .ctx("checking the worker's privileges")
    }

    /// The newest migration this binary knows.
    pub fn schema_version_needed() -> i64 {
        MIGRATOR.iter().map(|m| m.version).max().unwrap_or(0)
    }

    /// Checks that the schema is at least the version this binary needs. A
    /// newer schema is accepted (migrations are additive: rolling upgrades run
    /// new workers and old ones against one database). Returns the version found.
    pub async fn check_schema(&self) -> Result<i64, DbError> {
        self.connection("reading the schema version")
            .await?
            .conn()
            .check_schema()
            .await
    }

    /// A connection of the pool to keep across operations (see
    /// [`DbConnection`]); `context` names what it is for, as the error of
    /// its first statement would have.
    pub async fn connection(&self, context: &'static str) -> Result<DbConnection, DbError> {
        Ok(DbConnection(self.pool.acquire().await.ctx(context)?))
    }

    /// Whether another user of the pool would get a connection now without
    /// waiting: one is idle, or the pool may still open one.
    pub fn has_spare_connection(&self) -> bool {
        self.pool.num_idle() > 0 || self.pool.size() < self.pool.options().get_max_connections()
    }

    /// Begins a transaction: run operations on it with
    /// [`DbTransaction::conn`], then commit (see the module documentation).
    pub async fn begin(&self) -> Result<DbTransaction, DbError> {
        let mut guard = BeginInFlight(true);
        let tx = self.pool.begin().await.ctx("beginning a transaction")?;
        guard.0 = false;
        Ok(DbTransaction { tx })
    }

    /// Runs `f` in one transaction: committed when it returns `Ok`, rolled
    /// back when it returns `Err` (or panics, or its future is dropped).
    pub async fn transaction<T, E, F>(&self, f: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&mut DbConn<'_>) -> Result<T, E>,
        E: From<DbError>,
    {
        let mut tx = self.begin().await?;
        let out = f(&mut tx.conn()).await;
        match out {
            Ok(v) => {
                tx.commit().await?;
                Ok(v)
            }
            Err(e) => {
                // the caller's error is the one to report; a failed rollback
                // ends the connection (sqlx closes it), nothing is committed
                let _ = tx.rollback().await;
                Err(e)
            }
        }
    }

    /// Applies the migrations; safe to run again and from several processes at
    /// once (they take turns on an advisory lock). The bookkeeping table lives
    /// in the runtime's schema too, not in `public`. Returns the schema's
    /// version afterwards, which is newer than [`Db::schema_version_needed`]
    /// when a newer binary migrated it (nothing to apply then).
    pub async fn migrate(&self) -> Result<i64, DbError> {
        Ok(self.migrate_counted().await?.version)
    }

    /// [`Db::migrate`], saying how many migrations this call applied (none
    /// when the schema was up to date, or another `migrate` did them first).
    pub async fn migrate_counted(&self) -> Result<Migrated, DbError> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .ctx("acquiring a connection to migrate")?;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *conn)
            .await
            .ctx("waiting for another migrate to finish (advisory lock)")?;
        let res = Self::migrate_locked(&mut conn).await;
        // a session lock outlives the call: give it back before the
        // connection returns to the pool (closing it would too)
        let unlock = sqlx::query("SELECT pg_advisory_unlock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *conn)
            .await
            .ctx("releasing the migrate lock");
        let migrated = res?;
        unlock?;
        Ok(migrated)
    }

    /// The schema's version when every migration of this binary is applied
    /// to it, with the same checksum (sqlx would refuse a changed one);
    /// `None` when something is left to apply or to check.
    async fn up_to_date(conn: &mut sqlx::PgConnection) -> Result<Option<i64>, DbError> {
        let applied: Vec<(i64, Vec<u8>)> = match sqlx::query_as(
            "SELECT version, checksum FROM durable._sqlx_migrations WHERE success",
        )
        .fetch_all(&mut *conn)
        .await
        {
            Ok(rows) => rows,
            // no bookkeeping table yet (or not readable): let sqlx decide
            Err(e) => return bookkeeping_unreadable(e),
        };
        let all = MIGRATOR.iter().all(|m| {
            applied
                .iter()
                .any(|(v, c)| *v == m.version && c.as_slice() == &*m.checksum)
        });
        Ok(all.then(|| applied.iter().map(|(v, _)| *v).max().unwrap_or(0)))
    }

    async fn migrate_locked(conn: &mut sqlx::PgConnection) -> Result<Migrated, DbError> {
        // CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when
        // the schema is there (a DBA who made it for the deploy role grants
        // nothing more): only when it is missing. A schema the role cannot
        // use is named as such (it failed with "no schema has been selected
        // to create in")
        let (exists, usable): (bool, bool) = sqlx::query_as(
            "SELECT count(*) > 0, coalesce(bool_and(has_schema_privilege(oid, 'USAGE')), false)
               FROM pg_namespace WHERE nspname = 'durable'",
        )
        .fetch_one(&mut *conn)
        .await
        .ctx("looking for schema durable")?;
        if !exists {
            conn.execute("CREATE SCHEMA IF NOT EXISTS durable")
                .await
                .ctx("creating schema durable")?;
        } else if !usable {
            return Err(DbError::Privileges(
                "this role has no USAGE on schema durable: migrate as its owner (or GRANT USAGE, CREATE ON SCHEMA durable TO this role)".into(),
            ));
        } else if let Some(version) = Self::failed_migration(conn).await? {
            // one this binary does not know was "up to date" with exit 0,
            // while every other command refused the schema (audit 98)
            if version > Db::schema_version_needed() {
                return Err(DbError::SchemaFailed {
                    version,
                    fix: "It is newer than this binary: run `supervisor migrate` with the binary \
                          that has it, which names what to fix",
                });
            }
            if !MIGRATOR.iter().any(|m| m.version == version) {
                // none of this binary's: nobody can say what it changed
                // (audit 99: told to mark it done if its changes are there)
                return Err(DbError::MigrationAdvice(format!(
                    "durable._sqlx_migrations has a row for migration {version}, marked as \
                     failed, that no release of this binary has: it was written by hand or by \
                     another tool. Remove it (DELETE FROM durable._sqlx_migrations WHERE version \
                     = {version}) and run `supervisor migrate` again"
                )));
            }
            return Err(DbError::MigrationAdvice(
                migrate_advice(&sqlx::migrate::MigrateError::Dirty(version)).unwrap_or_default(),
            ));
        } else if let Some(version) = Self::up_to_date(conn).await? {
            // nothing to apply: done without sqlx's CREATE TABLE IF NOT
            // EXISTS, which needs CREATE on the schema even when the table
            // is there (a worker's or a submitter's role running migrate)
            return Ok(Migrated {
                version,
                applied: 0,
            });
        }
        let before = Self::applied_count(conn).await;
        let for_existing;
        let migrator = if exists {
            for_existing = Self::migrator_for_existing_schema();
            &for_existing
        } else {
            &MIGRATOR
        };
        conn.execute("SET search_path TO durable")
            .await
            .ctx("setting search_path")?;
        let res = migrator.run(&mut *conn).await;
        // the connection goes back to the pool: restore the default path
        conn.execute("RESET search_path")
            .await
            .ctx("resetting search_path")?;
        if let Err(e) = &res {
            if let Some(advice) = migrate_advice(e) {
                return Err(DbError::MigrationAdvice(advice));
            }
            if let Some(denied) = permission_denied(e) {
                // (re-check audit: a role with USAGE alone was told only
                // "permission denied for schema durable")
                return Err(DbError::Privileges(format!(
                    "{denied}: migrate as the owner of schema durable (README, \"Database roles\"), or GRANT CREATE ON SCHEMA durable to this role"
                )));
            }
        }
        res?;
        let version = sqlx::query_scalar::<_, Option<i64>>(
            "SELECT max(version) FROM durable._sqlx_migrations WHERE success",
        )
        .fetch_one(&mut *conn)
        .await
        .ctx("reading the schema version")?
        .unwrap_or(0);
        let after = Self::applied_count(conn).await;
        Ok(Migrated {
            version,
            applied: after.saturating_sub(before),
        })
    }

    /// The migrations as they apply to a schema that is already there: the
    /// first one's `CREATE SCHEMA IF NOT EXISTS durable` is then a no-op, but
    /// PostgreSQL checks CREATE on the database before it finds the schema,
    /// so a deploy role given only the schema a DBA made for it (`CREATE
    /// SCHEMA durable AUTHORIZATION durable_owner`) could not apply the first
    /// migration. That statement is left out; the checksum stays the one of
    /// the migration as written, since the schema ends the same either way.
    fn migrator_for_existing_schema() -> sqlx::migrate::Migrator {
        let mut migrations = MIGRATOR.migrations.to_vec();
        if let Some(first) = migrations.first_mut() {
            if first.sql.contains(CREATE_SCHEMA) {
                first.sql = first.sql.replacen(CREATE_SCHEMA, "", 1).into();
            }
        }
        // the fields MIGRATOR itself is built with
        sqlx::migrate::Migrator {
            migrations: migrations.into(),
            ignore_missing: MIGRATOR.ignore_missing,
            locking: MIGRATOR.locking,
            no_tx: MIGRATOR.no_tx,
        }
    }

    /// The oldest migration the schema records as failed, if any (none
    /// when there is no bookkeeping table yet).
    async fn failed_migration(conn: &mut sqlx::PgConnection) -> Result<Option<i64>, DbError> {
        match sqlx::query_scalar::<_, Option<i64>>(
            "SELECT min(version) FROM durable._sqlx_migrations WHERE NOT success",
        )
        .fetch_one(&mut *conn)
        .await
        {
            Ok(v) => Ok(v),
            Err(e) => bookkeeping_unreadable(e),
        }
    }

    /// How many migrations the schema records as applied (0 before the
    /// first: no ledger table yet).
    async fn applied_count(conn: &mut sqlx::PgConnection) -> usize {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM durable._sqlx_migrations WHERE success")
            .fetch_one(&mut *conn)
            .await
            .map_or(0, |n| n.max(0) as usize)
    }
}

impl DbConn<'_> {
    /// See [`Db::check_schema`].
    pub async fn check_schema(&mut self) -> Result<i64, DbError> {
        let mut s = Scope::enter(self.conn).await?;
        // a migration marked failed below the newest is a schema no binary
        // was written for (`migrate` refuses it too)
        let res = sqlx::query_as::<_, (Option<i64>, Option<i64>)>(
            "SELECT max(version) FILTER (WHERE success), min(version) FILTER (WHERE NOT success)
               FROM durable._sqlx_migrations",
        )
        .fetch_one(&mut *s)
        .await;
        let have = match res {
            Ok((_, Some(version))) => {
                return Err(DbError::SchemaFailed {
                    version,
                    fix: if version > Db::schema_version_needed() {
                        // this binary's migrate does not know it (re-check audit)
                        "It is newer than this binary: run `supervisor migrate` with the binary \
                         that has it, which names what to fix"
                    } else {
                        "Run `supervisor migrate`, which names what to fix"
                    },
                });
            }
            Ok((v, None)) => v.ok_or(DbError::SchemaMissing)?,
            Err(sqlx::Error::Database(e))
                if matches!(e.code().as_deref(), Some("42P01") | Some("3F000")) =>
            {
                return Err(DbError::SchemaMissing)
            }
            Err(e) => {
                return Err(DbError::Query {
                    context: "reading the schema version",
                    source: e,
                })
            }
        };
        s.done().await?;
        let need = Db::schema_version_needed();
        if have < need {
            return Err(DbError::SchemaTooOld { have, need });
        }
        Ok(have)
    }
}

/// A database URL with its password replaced, for messages and logs.
pub fn redact_url(url: &str) -> String {
    // every form of credential a connection string carries (a `password=`
    // query parameter, a `key=value` DSN's), then the userinfo's as `***`
    let url = crate::secrets::Redactor::none().redact_string(url.to_owned());
    let url = mask_unknown_url_parameters(&url);
    let url = url.as_str();
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_urls_unknown_parameters_are_named_without_values() {
        assert_eq!(
            super::unknown_url_parameters(
                "postgres://u@h/db?sslmode=require&sslpassword=KeyPW123&application_name=x&x#frag"
            ),
            ["sslpassword", "x"]
        );
        assert!(super::unknown_url_parameters("postgres://u:pw@h/db").is_empty());
        assert!(
            super::unknown_url_parameters("postgres://h/db?options=-c%20a%3Db&port=1").is_empty()
        );
    }

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(super::redact_url("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(
            super::redact_url("postgres://u@h:1/x?password=hunter2pw&sslmode=off"),
            "postgres://u@h:1/x?password=[REDACTED]&sslmode=off"
        );
        assert_eq!(
            super::redact_url("postgres://bob:TopSecret77@h/x?password=TopSecret77"),
            "postgres://bob:***@h/x?password=[REDACTED]"
        );
        // a parameter the driver does not know: its value is masked
        assert_eq!(
            super::redact_url(
                "postgres://bob:PW_W1@h:1/app?pasword=MyRealPassw0rd&sslmode=off&x#f"
            ),
            "postgres://bob:***@h:1/app?pasword=***&sslmode=off&x#f"
        );
        assert_eq!(
            super::redact_url("host=h port=1 user=bob password=TopSecret77 dbname=x"),
            "host=h port=1 user=bob password=[REDACTED] dbname=x"
        );
    }
}
