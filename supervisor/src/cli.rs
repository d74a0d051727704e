//! The `supervisor` command (CONTRACT §2). Exit codes: 0 ok; 1 a run failed
//! (watch) or a runtime error; 2 bad input (invalid spec, bad config, usage);
//! 3 a run was cancelled (watch); 4 unknown run or step.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{ConfigError, ExecutorConfig, WorkerConfig};
use crate::db::{ConnectError, Db, DbError, RunFilter};
use crate::terminal::cell;
use crate::worker::{Worker, WorkerError};

#[derive(Debug, Parser)]
#[command(
    name = "supervisor",
    version = concat!(env!("CARGO_PKG_VERSION"), " (schema ", env!("DURABLE_SCHEMA_VERSION"), ")"),
    about = "Durable workflow runtime: leases steps from PostgreSQL and runs them in Go/Python executors"
)]
pub struct Cli {
    /// PostgreSQL URL [default: the DATABASE_URL environment variable].
    // DATABASE_URL is read after parsing (`Cli::with_database_url_from_env`), not by clap's
    // `env`: clap counted a value from the environment as given, and every
    // usage line then said `--database-url <DATABASE_URL>` as if required
    #[arg(long, global = true)]
    pub database_url: Option<String>,
    /// Log format on stderr: text, or json (one object per line, with the
    /// fields of every enclosing span: worker, and run_id, step, step_run_id,
    /// attempt and kind on an attempt's lines).
    #[arg(long, global = true, env = "DURABLE_LOG_FORMAT", default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the migrations (safe to run again).
    Migrate,
    /// Run one worker until SIGTERM/SIGINT, then drain.
    Worker {
        /// The worker config (TOML); DURABLE_<KEY> variables override its top-level keys.
        #[arg(long, required_unless_present = "print_default_config")]
        config: Option<PathBuf>,
        /// Print every worker setting with a comment and its default (TOML), and exit.
        #[arg(long, conflicts_with = "config")]
        print_default_config: bool,
    },
    /// Validate and submit a workflow spec (a file, or - for stdin).
    Submit {
        /// The spec (JSON, CONTRACT §3): a file, or - for stdin.
        #[arg(value_name = "FILE")]
        file: String,
        /// Print {"run_id": "<uuid>"} instead of the bare id.
        #[arg(long)]
        json: bool,
    },
    /// Show a run and its steps, with each step's latest progress.
    Status {
        /// The run's id (as `submit` printed it; `runs` lists them).
        run_id: String,
        /// Print the run as JSON (run_id, name, state, steps with their
        /// state, attempt, error, events and artifacts) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List a run's progress events, in order per step, attempt and sequence.
    Events {
        /// The run's id.
        run_id: String,
        /// Only the events of this step.
        #[arg(long)]
        step: Option<String>,
        /// Only the last N events (in the listing's order: with --step, that
        /// step's newest; a step checkpointing without pause can have
        /// hundreds of thousands).
        #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
        last: Option<u32>,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List runs, newest first, with their step counts by state.
    Runs {
        /// Only runs in this state.
        #[arg(long, value_parser = ["pending", "running", "succeeded", "failed", "cancelled"])]
        state: Option<String>,
        /// Only runs of this name (exact).
        #[arg(long)]
        name: Option<String>,
        /// Only runs created within this long, like 30s, 10m, 2h, 3d (or 1h30m).
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        since: Option<std::time::Duration>,
        /// At most this many runs.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        limit: u32,
        /// Only runs listed after this one (created before it): the next
        /// page, given the last run id of the one before.
        #[arg(long, value_name = "RUN_ID")]
        before: Option<String>,
        /// Print a JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Follow a run until it is terminal: live progress bars on a terminal,
    /// plain lines otherwise. Exit 0 succeeded, 1 failed, 3 cancelled; 4
    /// unknown run; 5 could not follow it (the run goes on); 128 + the
    /// signal when one stopped the watch.
    Watch {
        /// The run's id.
        run_id: String,
        /// Plain lines even on a terminal.
        #[arg(long)]
        plain: bool,
        /// How often the database is read, in milliseconds.
        #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(50..=60_000))]
        interval_ms: u64,
    },
    /// An artifact's bytes, or its lineage back to the first inputs.
    Artifact {
        #[command(subcommand)]
        command: ArtifactCommand,
    },
    /// Request cancellation of a run, or of one step (durable).
    Cancel {
        /// The run's id.
        run_id: String,
        /// Cancel only this step (by its name in the spec); steps that
        /// depend on it then never run.
        #[arg(long, value_name = "NAME")]
        step: Option<String>,
    },
    /// Remove finished runs older than an age, with their steps, events,
    /// transitions, artifacts and unreferenced artifact bytes (what each
    /// worker's retention does on its own), in short batches.
    Gc(GcArgs),
    /// Local development: with no DATABASE_URL, starts its own PostgreSQL
    /// cluster under ./.dev/ (kept between runs), migrates, and runs a worker
    /// with the bundled Go and Python demo executors.
    Dev {
        /// Print the worker config (TOML) for the bundled demo executors, and exit.
        #[arg(long)]
        print_config: bool,
        /// Submit this spec (a file, or -) once the worker runs.
        #[arg(long)]
        submit: Option<String>,
        /// Stop (after draining) once nothing is running and no step this
        /// worker can run is left (steps only other executors could run are
        /// named on stderr, not waited for).
        #[arg(long)]
        exit_when_idle: bool,
        /// Port of the local cluster started under ./.dev/ when DATABASE_URL is unset.
        #[arg(long, default_value_t = 54330)]
        dev_port: u16,
        /// Logs on stderr even while the watch view of --submit's run is shown
        /// (else they go to ./.dev/dev.log).
        #[arg(short, long)]
        verbose: bool,
    },
    /// Start each configured executor, handshake, print its capabilities, stop it.
    Executors {
        /// The worker config (TOML) whose [[executors]] to start.
        #[arg(long)]
        config: PathBuf,
    },
    /// Run the protocol's behaviour scenarios against each configured executor; print a pass/fail table.
    Conformance {
        /// The worker config (TOML) whose [[executors]] to check.
        #[arg(long)]
        config: PathBuf,
        /// Only the executor of this name.
        #[arg(long)]
        executor: Option<String>,
        /// The kind behaving as demo.echo (default demo.echo).
        #[arg(long, value_name = "KIND")]
        kind_echo: Option<String>,
        /// The kind behaving as demo.sleep: cancel, deadline, progress (default demo.sleep).
        #[arg(long, value_name = "KIND")]
        kind_sleep: Option<String>,
        /// The kind behaving as demo.artifact (default demo.artifact).
        #[arg(long, value_name = "KIND")]
        kind_artifact: Option<String>,
        /// The kind behaving as demo.effect (default demo.effect).
        #[arg(long, value_name = "KIND")]
        kind_effect: Option<String>,
        /// Print the results as one JSON document instead of the table.
        #[arg(long)]
        json: bool,
    },
}

/// `supervisor artifact …`.
/// `supervisor gc`'s options.
#[derive(Debug, clap::Args)]
pub struct GcArgs {
    /// Remove runs that finished longer ago than this: 30s, 10m, 2h, 7d, 1h30m.
    #[arg(long, value_name = "DURATION", default_value = "7d", value_parser = parse_duration)]
    older_than: std::time::Duration,
    /// Count what would be removed; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// At most this many runs per transaction.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    batch_runs: u32,
    /// At most this many steps per transaction.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch_steps: u32,
    /// Leave the space to autovacuum: no VACUUM after the removal.
    #[arg(long)]
    no_vacuum: bool,
    /// The artifact directory (the workers' `artifact_dir`), if they use
    /// the directory store: files of removed blobs are deleted there.
    #[arg(long, value_name = "DIR", env = "DURABLE_ARTIFACT_DIR")]
    artifact_dir: Option<PathBuf>,
    /// Print a JSON object instead of a line.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ArtifactCommand {
    /// Write an artifact's bytes to a file (checked against its sha256).
    Get {
        /// The artifact's id (`status RUN_ID --json` lists each step's).
        id: String,
        /// Where to write (- for stdout); an existing file only with --force.
        #[arg(long)]
        out: PathBuf,
        /// Overwrite --out if it exists.
        #[arg(long)]
        force: bool,
        /// The shared directory of a `directory` artifact store (the
        /// workers' `artifact_dir`), for artifacts stored there.
        #[arg(long, env = "DURABLE_ARTIFACT_DIR", value_name = "DIR")]
        artifact_dir: Option<PathBuf>,
    },
    /// The artifacts it was derived from, through every step and attempt.
    Lineage {
        /// The artifact's id.
        id: String,
        /// A JSON tree instead of text.
        #[arg(long)]
        json: bool,
    },
}

/// `watch`'s exit code when it could not follow the run (the database was
/// unreachable, or went away): 1 is the run's failure.
pub const WATCH_LOST: u8 = 5;

#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Dev(#[from] crate::dev::DevError),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(
        "no database: pass --database-url or set DATABASE_URL (e.g. postgres://user@localhost/db); a worker also reads database_url from its config or DURABLE_DATABASE_URL"
    )]
    NoDatabase,
    #[error("cannot read {path}: {source}{}", read_hint(source))]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid spec: not JSON: {0}")]
    NotJson(String),
    #[error("invalid spec: {0}")]
    BadSpec(String),
    #[error("{0:?} is not a run id (a UUID)")]
    BadRunId(String),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Other(String),
    /// `watch` could not follow the run (its database, its connection): not
    /// the run's outcome, so not its exit code either.
    #[error(transparent)]
    Watching(Box<CliError>),
    /// The connection broke while the submit was on its way.
    #[error(transparent)]
    SubmitUncertain(DbError),
    /// `migrate` failed: a lacking grant is the owner's, not a reader's or
    /// a worker's (their GRANTs were the hint: deployment audit).
    #[error(transparent)]
    Migrate(DbError),
    /// Standard output refused the command's output (a full disk,
    /// `> /dev/full`): `println!` panicked (exit 101). A closed pipe is not
    /// this: it ends a printing command quietly (SIGPIPE, as for `cat`).
    #[error("cannot write to standard output: {0}")]
    Stdout(#[source] std::io::Error),
    /// The run was made, but its id could not be printed: said on stderr,
    /// so that whoever retries does not submit it twice.
    #[error("run {id} was submitted, but its id could not be written to standard output ({source}): it exists; do not submit it again")]
    SubmittedUnprinted {
        id: Uuid,
        #[source]
        source: std::io::Error,
    },
}

/// `print!` for a command's output: a write that fails ends the command with
/// [`CliError::Stdout`] (exit 1) instead of a panic. Flushed, so the failure
/// is seen where it happens.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        write!(stdout, $($arg)*)
            .and_then(|()| stdout.flush())
            .map_err(CliError::Stdout)?
    }};
}

/// `println!` as [`out!`] is `print!`.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, $($arg)*)
            .and_then(|()| stdout.flush())
            .map_err(CliError::Stdout)?
    }};
}

impl CliError {
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Db(DbError::InvalidSpec(_)) | CliError::NotJson(_) | CliError::BadSpec(_) => {
                2
            }
            CliError::Config(_) | CliError::NoDatabase | CliError::Read { .. } => 2,
            CliError::Usage(_) => 2,
            // what the config asks cannot be set up here (the stop budget,
            // the pool, work_dir's permissions): the config is to change
            CliError::Worker(WorkerError::Setup(_)) => 2,
            CliError::Connect(e) if e.is_bad_input() => 2,
            CliError::Db(DbError::NotFound(_)) | CliError::BadRunId(_) => 4,
            // watch's 1 means the run failed (CONTRACT §2)
            CliError::Watching(e) => match e.exit_code() {
                1 => WATCH_LOST,
                code => code,
            },
            _ => 1,
        }
    }

    /// What to do about it, when the message alone does not say.
    pub fn hint(&self) -> Option<&'static str> {
        match self {
            // the message names the fix (`migrate`): the database is fine
            CliError::Watching(e)
                if matches!(
                    **e,
                    CliError::Db(
                        DbError::SchemaTooOld { .. }
                            | DbError::SchemaMissing
                            | DbError::SchemaFailed { .. }
                    )
                ) =>
            {
                None
            }
            // a role that may not read the run: the grants, not the
            // database, are to check (docs audit)
            CliError::Watching(e)
                if matches!(&**e, CliError::Db(d) if d.sqlstate().as_deref() == Some("42501")) =>
            {
                e.hint()
            }
            CliError::Watching(e) if matches!(**e, CliError::Stdout(_)) => None,
            CliError::Watching(e) if e.exit_code() == 1 => Some(
                "watch could not follow the run, which is not affected: check the database (DATABASE_URL), then run `supervisor watch RUN_ID` again",
            ),
            CliError::Watching(e) => e.hint(),
            CliError::SubmitUncertain(_) => Some(
                "the connection broke before the database answered: the run may or may not have been created. `supervisor runs` lists the newest runs; a spec with an idempotency_key can be submitted again safely (it answers with the same run)",
            ),
            CliError::Db(DbError::NotFound(m)) if m.starts_with("unknown run") => {
                Some("`supervisor runs` lists the newest runs and their ids")
            }
            CliError::BadRunId(_) => Some("`supervisor runs` lists the newest runs and their ids"),
            CliError::Db(DbError::NotFound(m)) if m.starts_with("unknown artifact") => {
                Some("`supervisor status RUN_ID --json` lists each step's artifacts and their ids")
            }
            CliError::NotJson(_) => {
                Some("a spec is one JSON object: {\"name\": ..., \"steps\": [...]} (CONTRACT §3)")
            }
            // the README's roles name what each command needs (security
            // audit: a reader with SELECT alone read only "permission denied
            // for schema durable")
            // the grant this command needs, by what it does (audit 98:
            // every role's grants listed for any command)
            CliError::Db(e) if e.sqlstate().as_deref() == Some("42501") => {
                Some(privilege_hint(&subcommand_name()))
            }
            CliError::Migrate(e) if e.sqlstate().as_deref() == Some("42501") => Some(
                "migrate creates and changes the durable schema: run it as the schema's owner (README \"Database roles\", steps 1 and 2); the first migrate needs CREATE on the database, or a schema a DBA made for the owner (CREATE SCHEMA durable AUTHORIZATION <owner>)",
            ),
            CliError::Db(e) if e.sqlstate().as_deref() == Some("55P03") => Some(
                "another transaction held the rows for over 10 s (an open psql session, a long cancel or gc): this command gave up waiting, and made no change if it was to make one; end that transaction, or try again",
            ),
            _ => None,
        }
    }
}

/// What a command refused for a privilege needs granted (README "Database
/// roles"), by the command.
fn privilege_hint(command: &str) -> &'static str {
    match command {
        "status" | "runs" | "events" | "watch" | "artifact" => {
            "this command reads: its role needs USAGE on the schema and SELECT on its tables (as the schema's owner: GRANT USAGE ON SCHEMA durable TO <role>; GRANT SELECT ON ALL TABLES IN SCHEMA durable TO <role>; README \"Database roles\", the reader)"
        }
        "submit" | "cancel" => {
            "this command submits or cancels through durable.submit_run / durable.cancel_run: its role needs USAGE on the schema and EXECUTE on them (as the schema's owner: GRANT USAGE ON SCHEMA durable TO <role>; GRANT EXECUTE ON FUNCTION durable.submit_run(jsonb), durable.cancel_run(uuid, text, text) TO <role>; README \"Database roles\", the submitter)"
        }
        "gc" => {
            "gc --dry-run only counts: its role needs USAGE on the schema and SELECT on its tables; gc removes old runs as a worker's retention does: its role needs a worker's grants (as the schema's owner: GRANT USAGE ON SCHEMA durable TO <role>; GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA durable TO <role>; README \"Database roles\", the worker)"
        }
        _ => {
            "this database role lacks a grant the command needs: readers need USAGE ON SCHEMA durable and SELECT ON ALL TABLES IN SCHEMA durable; submitters USAGE and EXECUTE on durable.submit_run and durable.cancel_run; gc and workers a worker's grants (SELECT, INSERT, UPDATE, DELETE on the schema's tables) (README \"Database roles\" has the GRANTs)"
        }
    }
}

/// The subcommand this process runs (`status`), as typed: the first
/// argument that names one.
fn subcommand_name() -> String {
    use clap::CommandFactory;
    let names: Vec<String> = Cli::command()
        .get_subcommands()
        .map(|c| c.get_name().to_owned())
        .collect();
    std::env::args()
        .skip(1)
        .find(|a| names.contains(a))
        .unwrap_or_else(|| "supervisor".to_owned())
}

/// Whether `dev --submit` shows the watch view: stdout is a terminal and
/// `-v` was not given.
fn dev_watches(cli: &Cli) -> bool {
    use std::io::IsTerminal;
    matches!(
        &cli.command,
        Command::Dev {
            submit: Some(_),
            verbose: false,
            print_config: false,
            ..
        }
    ) && std::io::stdout().is_terminal()
}

/// `dev` with the watch view logs to ./.dev/dev.log, so log lines do not
/// tear the bars; `None` (stderr) when that file cannot be opened.
fn dev_log_file(cli: &Cli) -> Option<std::fs::File> {
    if !dev_watches(cli) {
        return None;
    }
    let dir = std::env::current_dir().ok()?.join(".dev");
    std::fs::create_dir_all(&dir).ok()?;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("dev.log"))
        .ok()
}

/// A log writer that keeps each event on one line and out of the
/// terminal's control: a newline or carriage return inside an event (an
/// executor's error message or code, which the text format writes as they
/// are) is escaped, so that no value can start a line that looks like
/// another event (observability audit: a `demo.fail` message forged an
/// "attempt finished outcome=succeeded" line), and so is every other control
/// character (an escape sequence in a code or an SDK name cleared the
/// operator's screen or set its title; security audit) but a tab. With
/// `ansi` the formatter's own colours (`ESC [ … m`) are kept: a value can
/// then at most change a colour. The fmt layer writes each event whole, in
/// one `write_all`.
struct OneLine<M> {
    inner: M,
    ansi: bool,
}

impl<'a, M: tracing_subscriber::fmt::MakeWriter<'a>> tracing_subscriber::fmt::MakeWriter<'a>
    for OneLine<M>
{
    type Writer = OneLine<M::Writer>;
    fn make_writer(&'a self) -> Self::Writer {
        OneLine {
            inner: self.inner.make_writer(),
            ansi: self.ansi,
        }
    }
}

impl<W: std::io::Write> std::io::Write for OneLine<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self.inner.write_all(&one_line(buf, self.ansi)) {
            // nobody reads the log any more (`worker 2>&1 | head`, a
            // collector that died): the line is dropped and the worker goes
            // on. As an error it reached tracing's fallback, an eprintln!,
            // which panicked on the same closed pipe: the worker died
            // (exit 101) instead of draining (deployment audit)
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(buf.len()),
            Err(e) => Err(e),
            Ok(()) => Ok(buf.len()),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self.inner.flush() {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            other => other,
        }
    }
}

/// Writes a line to stderr, or nothing when stderr is closed: `eprintln!`
/// panics then, and a command's last word is not worth exit 101 instead of
/// its own code.
fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// Whether the parameters of an SGR sequence (`ESC [ params m`) are ones
/// the formatter writes itself: reset, bold, dim, italic and the level
/// colours red to magenta. Anything else in an event (conceal, black, 256
/// colours, backgrounds) came from a value, and could hide text.
fn formatter_sgr(params: &[u8]) -> bool {
    params.split(|&b| b == b';').all(|p| {
        matches!(
            p,
            b"" | b"0" | b"1" | b"2" | b"3" | b"31" | b"32" | b"33" | b"34" | b"35"
        )
    })
}

/// An event as [`OneLine`] writes it: its final newline kept, every other
/// control character (C0 but a tab, DEL, C1, and the Unicode line and
/// paragraph separators) written as an escape; with `ansi`, SGR sequences
/// (`ESC [` digits and `;` `m`) are kept.
fn one_line(buf: &[u8], ansi: bool) -> std::borrow::Cow<'_, [u8]> {
    // (the formatter writes UTF-8; a byte that is not would be shown as
    // U+FFFD by any reader, and is written so)
    let text = String::from_utf8_lossy(buf);
    let body = text.strip_suffix('\n').unwrap_or(&text);
    // with colours, the formatter's own SGR sequence starting at byte `i`
    let sgr_at = |i: usize| -> Option<usize> {
        let rest = body.get(i + 1..)?.strip_prefix('[')?;
        let params = rest.find(|c: char| !(c.is_ascii_digit() || c == ';'))?;
        (rest[params..].starts_with('m') && formatter_sgr(&rest.as_bytes()[..params]))
            .then_some(1 + 1 + params + 1)
    };
    let unsafe_at = |(i, c): &(usize, char)| {
        *c != '\t'
            && crate::terminal::is_unsafe(*c)
            && !(ansi && *c == '\u{1b}' && sgr_at(*i).is_some())
    };
    if matches!(text, std::borrow::Cow::Borrowed(_)) && !body.char_indices().any(|x| unsafe_at(&x))
    {
        return std::borrow::Cow::Borrowed(buf);
    }
    let mut out = String::with_capacity(buf.len() + 16);
    let mut skip_to = 0;
    for (i, c) in body.char_indices() {
        if i < skip_to {
            continue;
        }
        if !unsafe_at(&(i, c)) {
            if c == '\u{1b}' {
                // a kept SGR sequence, whole
                let len = sgr_at(i).unwrap_or(1);
                out.push_str(&body[i..i + len]);
                skip_to = i + len;
            } else {
                out.push(c);
            }
            continue;
        }
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            // the C0 controls the json format never writes as they are
            // (it escapes them itself): `\x1b` reads best
            c if (c as u32) < 0x20 => out.push_str(&format!("\\x{:02x}", c as u32)),
            // DEL, C1, separators and bidi marks, which the json format
            // does write as they are: as `\uXXXX`, their JSON escape, a line
            // of it stays JSON with the same value
            c => out.push_str(&format!("\\u{:04x}", c as u32)),
        }
    }
    out.push_str(&text[body.len()..]);
    std::borrow::Cow::Owned(out.into_bytes())
}

/// Two of the driver's warnings, whatever `RUST_LOG` says, are errors only:
/// its URL parser logs a parameter it does not know with its value, which
/// may be a password (`?sslpassword=…`; security audit; `Db::connect` names
/// such parameters without their values), and its pool logs every broken
/// connection it finds as it takes one back after a database restart, a
/// burst of "Broken pipe" beside the worker's own lines, which say what
/// failed and that it retries (chaos audit). The server's notices are
/// errors only too: a restart's "terminating connection due to immediate
/// shutdown command" came as a WARN above a command's own error, which says
/// what failed (DB fault audit).
fn quiet_driver(filter: tracing_subscriber::EnvFilter) -> tracing_subscriber::EnvFilter {
    [
        "sqlx_postgres::options::parse=error",
        "sqlx_core::pool::connection=error",
        "sqlx::postgres::notice=error",
    ]
    .iter()
    .filter_map(|d| d.parse().ok())
    .fold(filter, |f, d| f.add_directive(d))
}

fn init_tracing_to(format: &str, file: std::fs::File) {
    use tracing_subscriber::EnvFilter;
    let filter = quiet_driver(
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn")),
    );
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(OneLine {
            inner: std::sync::Mutex::new(file),
            ansi: false,
        });
    let _ = if format == "json" {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init()
    } else {
        builder.try_init()
    };
}

fn init_tracing(format: &str, default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = quiet_driver(
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter)),
    );
    // colours only on a terminal: a log file or a collector gets plain text
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        // a failed write is reported by tracing on stderr: the stream that
        // just failed (a closed pipe is no failure: see OneLine)
        .log_internal_errors(false)
        .with_writer(OneLine {
            inner: std::io::stderr,
            ansi,
        });
    let _ = if format == "json" {
        builder
            .json()
            .with_current_span(true)
            .with_span_list(true)
            .try_init()
    } else {
        builder.try_init()
    };
}

/// A `DURABLE_LOG_FORMAT` that clap would refuse, named: clap's error named
/// only `--log-format`, which the user did not type (observability audit).
/// Clap refuses such a value even beside an explicit `--log-format`.
pub fn check_log_format_env() -> Result<(), String> {
    match std::env::var("DURABLE_LOG_FORMAT") {
        Ok(v) if v != "text" && v != "json" => Err(format!(
            "DURABLE_LOG_FORMAT={v:?} is not a log format: set it to text or json, or unset it"
        )),
        _ => Ok(()),
    }
}

/// Clap refused the command line (or was asked for help or the version,
/// which it prints as usual). With the JSON log format asked for on the
/// command line or in `DURABLE_LOG_FORMAT`, the refusal is one JSON log
/// line, as every other fatal error is, with the usage as its hint: a
/// collector parsing the log met clap's plain lines among the JSON ones.
pub fn usage_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    let code = u8::try_from(e.exit_code()).unwrap_or(2);
    let asked_for = matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion);
    if asked_for || !json_log_asked(std::env::args_os().skip(1)) {
        // clap's own output (help on stdout, an error on stderr); a failed
        // write is no panic
        let _ = e.print();
        return ExitCode::from(code);
    }
    init_tracing("json", "info");
    let (message, hint) = if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        // clap's answer is the whole help text
        (
            "no command given".to_owned(),
            Some("`supervisor --help` lists the commands".to_owned()),
        )
    } else {
        let text = e.render().to_string();
        let mut parts = text.trim().splitn(2, "\n\n");
        let first = parts.next().unwrap_or_default();
        let first = first.strip_prefix("error: ").unwrap_or(first);
        let message = first.split_whitespace().collect::<Vec<_>>().join(" ");
        let hint = parts
            .next()
            .map(|h| h.split_whitespace().collect::<Vec<_>>().join(" "));
        (message, hint)
    };
    match hint {
        Some(hint) => tracing::error!(exit_code = code, hint, "{message}"),
        None => tracing::error!(exit_code = code, "{message}"),
    }
    ExitCode::from(code)
}

/// Whether the arguments (before a `--`) or `DURABLE_LOG_FORMAT` ask for
/// the JSON log format (the arguments win, as clap's `env` has them).
fn json_log_asked(args: impl Iterator<Item = std::ffi::OsString>) -> bool {
    let mut asked = std::env::var("DURABLE_LOG_FORMAT").ok();
    let mut args = args.map(|a| a.to_string_lossy().into_owned());
    while let Some(a) = args.next() {
        if a == "--" {
            break;
        }
        if a == "--log-format" {
            // a flag without its value leaves the variable's word
            if let Some(v) = args.next() {
                asked = Some(v);
            }
        } else if let Some(v) = a.strip_prefix("--log-format=") {
            asked = Some(v.to_owned());
        }
    }
    asked.as_deref() == Some("json")
}

impl Cli {
    /// `--database-url`, or else DATABASE_URL (as clap's `env` would, but
    /// without the usage lines naming the flag as given). An empty flag is
    /// none, as an empty variable is. A value that is not UTF-8 is kept,
    /// lossily, for the commands that connect to refuse (naming it); the
    /// others never read it (re-check audit: `worker
    /// --print-default-config` failed on it).
    pub fn with_database_url_from_env(mut self) -> Cli {
        if self
            .database_url
            .as_deref()
            .is_some_and(|u| u.trim().is_empty())
        {
            self.database_url = None;
        }
        if self.database_url.is_none() {
            self.database_url = std::env::var_os("DATABASE_URL")
                .map(|v| v.to_string_lossy().into_owned())
                .filter(|u| !u.trim().is_empty());
        }
        self
    }
}

pub async fn main_with(cli: Cli) -> ExitCode {
    crate::db::name_sessions(&format!("durable {}", subcommand_name()));
    // a fatal error is a log line of its own with the json format on
    // stderr (not when the log goes to dev's file: it is said on stderr)
    let mut json_log = cli.log_format == "json";
    match dev_log_file(&cli) {
        Some(file) => {
            json_log = false;
            init_tracing_to(&cli.log_format, file)
        }
        // watch draws on the terminal and says itself when the database is
        // away: sqlx's own warnings (a lost connection) tore its view
        None if matches!(cli.command, Command::Watch { .. }) => {
            init_tracing(&cli.log_format, "warn,sqlx=off")
        }
        None => init_tracing(&cli.log_format, "info,sqlx=warn"),
    }
    let json_log = json_log && tracing::enabled!(tracing::Level::ERROR);
    match run(cli).await {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            if json_log {
                // one JSON object per line, as the log promises (a
                // collector parsing it met two plain lines; operator's
                // tools audit)
                match e.hint() {
                    Some(hint) => tracing::error!(exit_code = e.exit_code(), hint, "{e}"),
                    None => tracing::error!(exit_code = e.exit_code(), "{e}"),
                }
            } else {
                say(format_args!("error: {}", printable(&e.to_string())));
                if let Some(hint) = e.hint() {
                    say(format_args!("hint: {hint}"));
                }
            }
            ExitCode::from(e.exit_code())
        }
    }
}

/// Connects to the database named by `url`, explaining a failure in terms
/// of the URL. `fail_fast`: a short command, which reports a server that is
/// down at once instead of waiting out the pool's acquire timeout.
async fn connect(url: &Option<String>, conns: u32, fail_fast: bool) -> Result<Db, CliError> {
    let url = url
        .as_deref()
        .filter(|u| !u.trim().is_empty())
        .ok_or(CliError::NoDatabase)?;
    Ok(Db::connect_explained(url, conns, fail_fast).await?)
}

/// [`connect`] for the commands that read (and `cancel`), with the schema's
/// version checked as `submit` checks it: on a schema older than the binary
/// they failed on the first function it lacks, with a raw SQL error (and
/// `watch` with exit 5, "database unreachable"; upgrade audit). A role that
/// may not read the migrations' ledger (a submitter's: EXECUTE only) is
/// not checked.
async fn connect_checked(url: &Option<String>) -> Result<Db, CliError> {
    let db = connect(url, 2, true).await?;
    match db.check_schema().await {
        Err(e) if e.sqlstate().as_deref() == Some("42501") => {}
        r => {
            r?;
        }
    }
    Ok(db)
}

/// A query that failed because the schema is not there is a missing
/// migration, not a mystery: say so.
fn explain(e: DbError) -> CliError {
    match e.sqlstate().as_deref() {
        // undefined_table, invalid_schema_name
        Some("42P01") | Some("3F000") => CliError::Db(DbError::SchemaMissing),
        _ => CliError::Db(e),
    }
}

fn parse_run_id(s: &str) -> Result<Uuid, CliError> {
    Uuid::parse_str(s.trim()).map_err(|_| CliError::BadRunId(s.to_owned()))
}

async fn run(cli: Cli) -> Result<u8, CliError> {
    let watch_dev = dev_watches(&cli);
    let url = cli.database_url;
    match cli.command {
        Command::Migrate => migrate(&url).await,
        Command::Submit { file, json } => submit(&url, &file, json).await,
        Command::Status { run_id, json } => status(&url, &run_id, json).await,
        Command::Events {
            run_id,
            step,
            last,
            json,
        } => events(&url, &run_id, step.as_deref(), last, json).await,
        Command::Runs {
            state,
            name,
            since,
            limit,
            before,
            json,
        } => {
            let before = before.as_deref().map(parse_run_id).transpose()?;
            let filter = RunFilter {
                state,
                name,
                since,
                limit,
                before,
            };
            runs(&url, &filter, json).await
        }
        Command::Watch {
            run_id,
            plain,
            interval_ms,
        } => watch(&url, &run_id, plain, interval_ms).await,
        Command::Artifact { command } => artifact(&url, command).await,
        Command::Cancel { run_id, step } => cancel(&url, &run_id, step.as_deref()).await,
        Command::Gc(args) => gc(&url, args).await,
        Command::Worker {
            config,
            print_default_config,
        } => worker(&url, config, print_default_config).await,
        Command::Dev {
            print_config,
            submit,
            exit_when_idle,
            dev_port,
            verbose: _,
        } => {
            let opts = DevOptions {
                print_config,
                submit,
                exit_when_idle,
                dev_port,
                watch: watch_dev,
            };
            dev(url, opts).await
        }
        Command::Conformance {
            config,
            executor,
            kind_echo,
            kind_sleep,
            kind_artifact,
            kind_effect,
            json,
        } => {
            let kinds = crate::conformance::Kinds {
                echo: kind_echo,
                sleep: kind_sleep,
                artifact: kind_artifact,
                effect: kind_effect,
            };
            until_stopped(conformance(&config, executor.as_deref(), &kinds, json)).await
        }
        Command::Executors { config } => until_stopped(executors(&config)).await,
    }
}

/// `supervisor migrate`.
async fn migrate(url: &Option<String>) -> Result<u8, CliError> {
    let db = connect(url, 2, false).await?;
    let crate::db::Migrated { version, applied } =
        db.migrate_counted().await.map_err(CliError::Migrate)?;
    let mine = Db::schema_version_needed();
    if version > mine {
        eprintln!(
            "the schema is at version {version}, newer than this binary's {mine}: nothing to \
             apply (migrations are additive; this binary runs on it)"
        );
    } else if applied == 0 {
        // (two concurrent runs both said "migrations applied"; upgrade audit)
        eprintln!("the schema is up to date (version {version}): nothing to apply");
    } else {
        eprintln!(
            "applied {applied} migration{} (schema version {version})",
            if applied == 1 { "" } else { "s" }
        );
    }
    Ok(0)
}

/// `supervisor submit FILE|-`: the new run's id on stdout.
async fn submit(url: &Option<String>, file: &str, json: bool) -> Result<u8, CliError> {
    let text = read_input(file)?;
    let spec: serde_json::Value = parse_spec(&text)?;
    let db = connect(url, 2, true).await?;
    // no DDL here: a submitter needs no schema rights, and an older CLI never
    // migrates a newer schema; it only checks the version
    db.check_schema().await?;
    let submitted = db.submit_telling(&spec).await.map_err(|e| {
        if e.outcome_unknown() {
            CliError::SubmitUncertain(e)
        } else {
            CliError::Db(e)
        }
    })?;
    let id = submitted.id;
    if let Some(note) = known_key_note(&spec, &submitted) {
        eprintln!("{note}");
    }
    let line = if json {
        serde_json::json!({ "run_id": id }).to_string()
    } else {
        id.to_string()
    };
    print_submitted(id, &line)?;
    Ok(0)
}

/// A submitted run's id line on stdout; one that cannot be written is
/// [`CliError::SubmittedUnprinted`], which names the run on stderr.
fn print_submitted(id: Uuid, line: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")
        .and_then(|()| stdout.flush())
        .map_err(|source| CliError::SubmittedUnprinted { id, source })
}

/// What to tell the submitter on stderr when the spec's idempotency key named
/// a run that exists: its id is printed all the same (a retried submit is
/// safe), but a spec that differs from the run's was not submitted at all.
fn known_key_note(spec: &serde_json::Value, submitted: &crate::db::Submitted) -> Option<String> {
    use crate::db::SubmitOutcome;
    let key = spec.get("idempotency_key").map(|k| k.to_string())?;
    let id = submitted.id;
    match submitted.outcome? {
        SubmitOutcome::Created => None,
        SubmitOutcome::KnownSameSpec => Some(format!(
            "idempotency key {key} already names run {id}, made from this same spec: \
             nothing new was submitted"
        )),
        SubmitOutcome::KnownOtherSpec => Some(format!(
            "warning: idempotency key {key} already names run {id}, made from a different \
             spec: this spec was NOT submitted, and the id printed is that run's. To run it \
             as a new run, give it another idempotency key (or none)"
        )),
    }
}

/// `supervisor status RUN`.
async fn status(url: &Option<String>, run_id: &str, json: bool) -> Result<u8, CliError> {
    let id = parse_run_id(run_id)?;
    let db = connect_checked(url).await?;
    let status = db.status(id).await.map_err(explain)?;
    let progress = db.latest_progress(id).await.map_err(explain)?;
    // why a step waits: no live worker offers what it needs
    let unroutable = db.unroutable_steps(id).await.map_err(explain)?;
    // or every live worker that offers it has paused what would run it
    let paused = db.steps_paused_for(id).await.map_err(explain)?;
    if json {
        outln!("{}", status_json(&status, &progress, &unroutable, &paused));
    } else {
        out!("{}", status_text(&status, &progress));
        out!("{}", unroutable_text(&unroutable));
        out!("{}", paused_text(&paused));
    }
    Ok(0)
}

/// Why steps wait although live workers offer them: each of those workers
/// paused the executor that would run them (or itself). Steps waiting for
/// the same pauses are one line past [`UNROUTABLE_LINES`].
fn paused_text(steps: &[crate::db::PausedStep]) -> String {
    let why = steps.iter().map(|p| {
        let who = p
            .paused_by
            .iter()
            .map(|b| {
                let since = chrono::DateTime::parse_from_rfc3339(&b.since)
                    .map(|t| format!(" since {}", when(&t.with_timezone(&chrono::Utc))))
                    .unwrap_or_default();
                format!(
                    "worker {} executor {}{since}: {}",
                    cell(&b.worker, 80),
                    cell(&b.executor, 80),
                    cell(&b.why, 300)
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        (
            p.step.step.as_str(),
            format!(
                "every live worker that offers {} has paused it ({who})",
                p.step.needs()
            ),
        )
    });
    waiting_lines(why, "one to resume")
}

/// Why steps wait: a line per step that needs what no live worker offers.
/// More than [`UNROUTABLE_LINES`] steps needing the same are one line that
/// counts them and names the first few (a 1,000-step run printed 1,000 alike
/// lines).
fn unroutable_text(steps: &[crate::db::StuckStep]) -> String {
    let why = steps.iter().map(|s| {
        (
            s.step.as_str(),
            format!("no live worker offers {}", s.needs()),
        )
    });
    waiting_lines(why, "one")
}

/// `step: WHY: it waits for FOR` per (step, why), in order; more than
/// [`UNROUTABLE_LINES`] steps with the same why are one line that counts
/// them and names the first few.
fn waiting_lines<'a>(why: impl Iterator<Item = (&'a str, String)>, waits_for: &str) -> String {
    let mut by_why: Vec<(String, Vec<&str>)> = Vec::new();
    for (step, w) in why {
        match by_why.iter_mut().find(|(c, _)| *c == w) {
            Some((_, names)) => names.push(step),
            None => by_why.push((w, vec![step])),
        }
    }
    let mut out = String::new();
    for (w, names) in by_why {
        if names.len() <= UNROUTABLE_LINES {
            for name in names {
                out.push_str(&format!(
                    "{}: {w}: it waits for {waits_for}\n",
                    cell(name, 40)
                ));
            }
        } else {
            let first: Vec<String> = names
                .iter()
                .take(UNROUTABLE_LINES)
                .map(|n| cell(n, 40))
                .collect();
            out.push_str(&format!(
                "{} steps ({}, …): {w}: they wait for {waits_for}\n",
                names.len(),
                first.join(", ")
            ));
        }
    }
    out
}

/// Steps needing the same named one per line, up to this many.
const UNROUTABLE_LINES: usize = 5;

/// `supervisor events RUN [--step NAME]`.
async fn events(
    url: &Option<String>,
    run_id: &str,
    step: Option<&str>,
    last: Option<u32>,
    json: bool,
) -> Result<u8, CliError> {
    let id = parse_run_id(run_id)?;
    let db = connect_checked(url).await?;
    if last.is_none() {
        return all_events(&db, id, step, json).await;
    }
    let events = db.events(id, step, last).await.map_err(explain)?;
    if json {
        outln!("{}", pretty_json(&events)?);
    } else if events.is_empty() {
        // "yet" only of what may still run (a step cancelled before it ran
        // was said to have "no progress events yet")
        let st = db.status(id).await.map_err(explain)?;
        out!("{}", no_events_text(&st, step));
    } else {
        out!("{}", events_text(&events));
    }
    Ok(0)
}

/// Events a page of `events`' table holds: its columns are as wide as its
/// own rows need (a run with fewer events prints one table, as before).
const EVENTS_PAGE: usize = 5000;

/// `events` without `--last`: every event, printed as it comes from the
/// database, a page at a time; the same text and JSON as one read.
async fn all_events(db: &Db, id: Uuid, step: Option<&str>, json: bool) -> Result<u8, CliError> {
    use std::io::Write;
    let mut failed: Option<std::io::Error> = None;
    let mut page: Vec<crate::db::EventRow> = Vec::new();
    let mut printed = 0u64;
    let handed = db
        .for_each_event(id, step, |e| {
            let res = if json {
                serde_json::to_string_pretty(&e)
                    .map_err(std::io::Error::other)
                    .and_then(|one| {
                        let indented = one.replace('\n', "\n  ");
                        let sep = if printed == 0 { "[\n  " } else { ",\n  " };
                        let mut stdout = std::io::stdout().lock();
                        write!(stdout, "{sep}{indented}")
                    })
            } else {
                page.push(e);
                if page.len() >= EVENTS_PAGE {
                    print_events_page(&mut page, printed < EVENTS_PAGE as u64)
                } else {
                    Ok(())
                }
            };
            printed += 1;
            match res {
                Ok(()) => true,
                Err(e) => {
                    failed = Some(e);
                    false
                }
            }
        })
        .await
        .map_err(explain)?;
    if let Some(e) = failed {
        return Err(CliError::Stdout(e));
    }
    if handed == 0 {
        if json {
            outln!("[]");
        } else {
            let st = db.status(id).await.map_err(explain)?;
            out!("{}", no_events_text(&st, step));
        }
    } else if json {
        outln!("\n]");
    } else if !page.is_empty() {
        let first = handed <= EVENTS_PAGE as u64;
        print_events_page(&mut page, first).map_err(CliError::Stdout)?;
    }
    Ok(0)
}

/// A page of `events`' table (a later one without its header line), and
/// the page emptied.
fn print_events_page(page: &mut Vec<crate::db::EventRow>, first: bool) -> std::io::Result<()> {
    use std::io::Write;
    let text = events_text(page);
    let text = if first {
        text.as_str()
    } else {
        text.split_once('\n').map_or("", |(_, rows)| rows)
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush()?;
    page.clear();
    Ok(())
}

/// `supervisor runs [filters]`.
async fn runs(url: &Option<String>, filter: &RunFilter, json: bool) -> Result<u8, CliError> {
    let db = connect_checked(url).await?;
    let (runs, more) = db.runs(filter).await.map_err(explain)?;
    if json {
        let page: Vec<RunJson> = runs.iter().map(RunJson::from).collect();
        outln!("{}", pretty_json(&page)?);
    } else {
        out!("{}", runs_text(&runs));
    }
    // a page that is not the last says so, on stderr (stdout stays the
    // table or the JSON array): 50 of 50,000 read as all of them (audit)
    if let (true, Some(last)) = (more, runs.last()) {
        say(format_args!(
            "(more runs match: the next {} with `--before {}`)",
            filter.limit, last.run_id
        ));
    }
    Ok(0)
}

/// One run of `runs --json`: its counts by state under `"step_counts"`, as
/// `status --json` has them, and under `"steps"` as before.
#[derive(serde::Serialize)]
struct RunJson<'a> {
    #[serde(flatten)]
    run: &'a crate::db::RunSummary,
    step_counts: &'a std::collections::BTreeMap<String, i64>,
}

impl<'a> From<&'a crate::db::RunSummary> for RunJson<'a> {
    fn from(run: &'a crate::db::RunSummary) -> Self {
        RunJson {
            run,
            step_counts: &run.steps,
        }
    }
}

fn pretty_json<T: serde::Serialize>(v: &T) -> Result<String, CliError> {
    serde_json::to_string_pretty(v).map_err(|e| CliError::Other(format!("encoding JSON: {e}")))
}

/// `supervisor watch RUN`: the exit code says how the run ended.
async fn watch(
    url: &Option<String>,
    run_id: &str,
    plain: bool,
    interval_ms: u64,
) -> Result<u8, CliError> {
    let followed = async {
        let id = parse_run_id(run_id)?;
        let db = connect_checked(url).await?;
        let mut opts = crate::watch::WatchOptions::for_stdout(plain);
        opts.interval = std::time::Duration::from_millis(interval_ms);
        let watched = crate::watch::watch(
            &db,
            id,
            &mut std::io::stdout(),
            &opts,
            crate::watch::stop_signal(),
        )
        .await;
        match watched {
            Ok(end) => Ok(end),
            Err(e) if e.is_transient() => {
                // what the user needs to know first: the database went away
                // (operator audit: only "pool timed out while waiting for an
                // open connection" was printed), for how long, and the
                // server's own reason where a new connection gets one
                // (audit 87: "Connection refused" was hidden)
                let why = db
                    .server_reason(&e, std::time::Duration::from_secs(2))
                    .await
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default();
                Err(CliError::Other(format!(
                    "the database stopped answering while watching the run, for {} s ({e}){why}",
                    opts.patience.as_secs()
                )))
            }
            Err(e) => Err(explain(e)),
        }
    };
    match followed.await {
        Ok(crate::watch::WatchEnd::OutputFailed(e)) => Err(CliError::Watching(Box::new(
            CliError::Stdout(std::io::Error::other(e)),
        ))),
        Ok(end) => Ok(end.exit_code()),
        Err(e) => Err(CliError::Watching(Box::new(e))),
    }
}

/// `supervisor cancel RUN [--step NAME]`.
async fn cancel(url: &Option<String>, run_id: &str, step: Option<&str>) -> Result<u8, CliError> {
    let id = parse_run_id(run_id)?;
    let db = connect_checked(url).await?;
    // read first only to word the answer: cancel_run itself decides, under
    // the run's lock
    // a submitter's role may call cancel_run and read nothing (README
    // "Database roles"): without SELECT the answer is worded from
    // cancel_run's alone (security audit: such a cancel failed on the read)
    fn readable<T>(r: Result<T, DbError>) -> Result<Option<T>, CliError> {
        match r {
            Err(e) if e.sqlstate().as_deref() == Some("42501") => Ok(None),
            r => r.map(Some).map_err(explain),
        }
    }
    let before = readable(db.run_state(id).await)?;
    // the named step's state before, likewise only for the wording
    let step_before = match (step, &before) {
        (Some(name), Some(b)) if !b.is_terminal() => readable(db.status(id).await)?
            .and_then(|st| st.steps.into_iter().find(|s| s.name == name))
            .map(|s| s.state),
        _ => None,
    };
    let state = match (db.cancel(id, step).await, step) {
        // the run's steps named, as `events --step` does (docs audit),
        // where this role may read them
        (Err(DbError::NotFound(m)), Some(_)) if m.contains("has no step") => {
            let names = readable(db.step_names(id).await).ok().flatten();
            return Err(CliError::Db(DbError::NotFound(match names {
                Some(names) => format!("{m}; {}", crate::db::its_steps_are(id, &names)),
                None => m,
            })));
        }
        (r, _) => r.map_err(explain)?,
    };
    let ended = |s: &str| {
        s.parse::<crate::state::StepState>()
            .is_ok_and(|s| s.is_terminal())
    };
    // a step that ended between the read before and the cancel (the read
    // before is stale then): read after, it ended with no cancel request
    let step_ended_first = match (step, &step_before) {
        (Some(name), Some(s)) if !ended(s) => readable(db.status(id).await)?
            .and_then(|st| st.steps.into_iter().find(|s| s.name == name))
            .filter(|s| ended(&s.state) && !s.cancel_requested)
            .map(|s| s.state),
        _ => None,
    };
    match (step, step_before, step_ended_first) {
        _ if before.is_some_and(|b| b.is_terminal()) => {
            eprintln!("run {id} already {state}; nothing to cancel")
        }
        (Some(name), Some(s), _) if ended(&s) => {
            eprintln!("step {name} already {s}; nothing to cancel (run is {state})")
        }
        (Some(name), _, Some(s)) => {
            eprintln!("step {name} already {s}; nothing to cancel (run is {state})")
        }
        // a run cancel_run found ended otherwise than cancelled was over
        // before it: it requests nothing then (its own request ends a run
        // cancelled, or leaves it running). Not read before (a role without
        // SELECT; re-check audit), or read before it ended (outside audit:
        // "cancellation requested; run is succeeded" for a run whose last
        // step ended between the read and the cancel)
        _ if step.is_none()
            && state.is_terminal()
            && state != crate::state::RunState::Cancelled =>
        {
            eprintln!("run {id} already {state}; nothing to cancel")
        }
        _ => eprintln!("cancellation requested; run is {state}"),
    }
    Ok(0)
}

/// The jobs one process of `e` serves before it is retired, for `executors`
/// (`None`: no limit): a persistent one's, from its hello's and its config's
/// (as the worker counts them); a one-shot process serves one.
fn jobs_per_process(e: &ExecutorConfig, from_hello: i32) -> Option<u32> {
    if !e.persistent {
        return Some(1);
    }
    match crate::worker::job_limit(Some(from_hello), e.max_jobs_per_process) {
        u32::MAX => None,
        n => Some(n),
    }
}

/// What `supervisor dev` was asked to do.
struct DevOptions {
    print_config: bool,
    submit: Option<String>,
    exit_when_idle: bool,
    dev_port: u16,
    /// The watch view of `--submit`'s run on the terminal.
    watch: bool,
}

/// `supervisor dev`: the demo executors' worker, on DATABASE_URL or on a
/// local cluster under ./.dev/ (stopped again at the end).
async fn dev(url: Option<String>, opts: DevOptions) -> Result<u8, CliError> {
    let builtin = dev_config(&repo_root());
    let dev_name = builtin.name.clone();
    let cfg = builtin.with_env(std::env::vars_os())?;
    crate::process::announce_reaper();
    if opts.print_config {
        // not dev's own name: a worker's name is its process slot, and a
        // plain worker started from this beside `dev` must not share it
        // (a name from DURABLE_NAME is printed as given)
        let name = if cfg.name == dev_name {
            Some("demo-worker-1".into())
        } else {
            cfg.name.clone()
        };
        // a database URL with a credential in it is not printed (security
        // audit: DURABLE_DATABASE_URL's password was): the worker reads it
        // from the environment as dev did
        let with_credential = cfg
            .database_url
            .as_deref()
            .is_some_and(|u| crate::db::redact_url(u) != u);
        let printed = WorkerConfig {
            name,
            database_url: cfg.database_url.clone().filter(|_| !with_credential),
            ..cfg.clone()
        };
        let note = if with_credential {
            "# database_url is left out: it holds a credential (set DURABLE_DATABASE_URL or\n\
             # DATABASE_URL where the worker runs, as for this command).\n"
        } else {
            ""
        };
        out!(
            "# `name` is the worker's process slot: give every worker its own (a restart under the\n\
             # same name ends the processes its previous incarnation left behind; that one's\n\
             # leases still run out on their own).\n{note}{}",
            toml::to_string_pretty(&printed).map_err(|e| CliError::Other(e.to_string()))?
        );
        return Ok(0);
    }
    crate::dev::ensure_executors(&cfg, &repo_root())?;
    let spec = opts
        .submit
        .as_deref()
        .map(|f| {
            let text = read_input(f)?;
            parse_spec(&text)
        })
        .transpose()?;
    // an empty DATABASE_URL is none (as for every command); the built-in
    // config's database_url comes from DURABLE_DATABASE_URL
    let url = url
        .filter(|u| !u.trim().is_empty())
        .or_else(|| cfg.database_url.clone().filter(|u| !u.trim().is_empty()));
    let cluster = match &url {
        Some(_) => None,
        None => {
            let c = crate::dev::DevCluster::ensure(
                &std::env::current_dir().unwrap_or_default().join(".dev"),
                opts.dev_port,
            )?;
            // how to look at the run from another shell while dev runs
            eprintln!(
                "dev PostgreSQL: {0} (export DATABASE_URL={0} to use `supervisor status`, `events`, `watch` … from another shell while dev runs)",
                c.url
            );
            Some(c)
        }
    };
    let url = url.or_else(|| cluster.as_ref().map(|c| c.url.clone()));
    let result = dev_session(url, cfg, spec, opts.exit_when_idle, opts.watch).await;
    if let Some(c) = cluster {
        c.stop();
    }
    result
}

/// `supervisor artifact get|lineage`.
async fn artifact(url: &Option<String>, command: ArtifactCommand) -> Result<u8, CliError> {
    let db = connect_checked(url).await?;
    match command {
        ArtifactCommand::Get {
            id,
            out,
            force,
            artifact_dir,
        } => {
            let id = crate::artifact_cmd::parse_artifact_id(&id)?;
            let store = crate::artifacts::ArtifactStore::reader(db.clone(), artifact_dir);
            let a = crate::artifact_cmd::get(&db, &store, id, &out, force)
                .await
                .map_err(|e| match e {
                    CliError::Db(e) => explain(e),
                    e => e,
                })?;
            if out.as_os_str() != "-" {
                eprintln!("{}", wrote_line(&a.name, a.size, &a.sha256, &out));
            }
        }
        ArtifactCommand::Lineage { id, json } => {
            let id = crate::artifact_cmd::parse_artifact_id(&id)?;
            let l = db.artifact_lineage(id).await.map_err(explain)?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&crate::artifact_cmd::lineage_json(&l))
                        .unwrap_or_default()
                );
            } else {
                out!("{}", crate::artifact_cmd::lineage_text(&l));
            }
        }
    }
    Ok(0)
}

/// `supervisor gc`: a retention pass now (or its preview).
async fn gc(url: &Option<String>, args: GcArgs) -> Result<u8, CliError> {
    let GcArgs {
        older_than,
        dry_run,
        batch_runs,
        batch_steps,
        no_vacuum,
        artifact_dir,
        json,
    } = args;
    let db = connect(url, 2, true).await?;
    db.check_schema().await?;
    if dry_run {
        let p = db.retention_preview(older_than).await.map_err(explain)?;
        if json {
            outln!("{}", serde_json::to_string(&p).unwrap_or_default());
        } else {
            outln!(
                "would remove {} runs finished before {} ({} steps, {} artifacts, {} artifact blobs no other run references)",
                p.runs,
                when(&p.cutoff),
                p.steps,
                p.artifacts,
                p.blobs
            );
        }
        return Ok(0);
    }
    let opts = crate::db::RetentionOptions {
        older_than,
        batch_runs,
        batch_steps,
        vacuum: !no_vacuum,
    };
    let stop = CancellationToken::new();
    spawn_interrupt_handler(stop.clone());
    let r = db.retention_pass(&opts, &stop).await.map_err(explain)?;
    let files = match &artifact_dir {
        Some(dir) => crate::artifacts::remove_deleted_files(&db, dir)
            .await
            .map_err(|e| {
                CliError::Other(format!(
                    "cannot delete the files of removed artifact blobs in {}: {e}",
                    dir.display()
                ))
            })?,
        None => {
            // files only a process that mounts the directory can delete
            // (retention audit: "0 files", and no word of 330 waiting)
            let waiting = db.removed_blob_files(1000).await.map_err(explain)?.len();
            if waiting > 0 {
                eprintln!(
                    "note: {waiting}{} removed blobs' files wait in the shared artifact directory: run `supervisor gc --artifact-dir DIR` where it is mounted (or a worker whose config has artifact_dir deletes them)",
                    if waiting == 1000 { "+" } else { "" }
                );
            }
            0
        }
    };
    if json {
        let mut v = serde_json::to_value(&r).unwrap_or_default();
        v["files_deleted"] = serde_json::json!(files);
        outln!("{v}");
    } else {
        outln!(
            "removed {} runs finished before {} ({} steps, {} artifacts, {} artifact blobs, {} unreferenced blobs and {} staged chunks of uncommitted uploads, {} files, {} worker rows) in {} {}; longest batch {:.1} ms{}{}",
            r.runs,
            r.cutoff.as_ref().map(when).unwrap_or_default(),
            r.steps,
            r.artifacts,
            r.blobs,
            r.garbage_blobs,
            r.garbage_chunks,
            files,
            r.workers,
            r.batches,
            if r.batches == 1 { "batch" } else { "batches" },
            r.longest_batch.as_secs_f64() * 1000.0,
            if r.vacuumed {
                format!("; VACUUM {:.1} ms", r.vacuum_time.as_secs_f64() * 1000.0)
            } else {
                String::new()
            },
            if r.interrupted {
                "; interrupted: run it again to remove the rest"
            } else {
                ""
            }
        );
    }
    // an interrupted pass is not done: `gc && …` must not go on as if it
    // were (operator audit: it exited 0)
    Ok(if r.interrupted { 130 } else { 0 })
}

/// `supervisor worker`: runs a worker until SIGTERM or SIGINT.
async fn worker(
    url: &Option<String>,
    config: Option<PathBuf>,
    print_default_config: bool,
) -> Result<u8, CliError> {
    if print_default_config {
        out!("{}", WorkerConfig::default_config_toml());
        return Ok(0);
    }
    let config = config.ok_or_else(|| {
        CliError::Usage("supervisor worker needs --config FILE (`supervisor worker --print-default-config` prints one to start from)".into())
    })?;
    let cfg = WorkerConfig::load(&config)?;
    crate::process::announce_reaper();
    for warning in cfg
        .ignored_settings()
        .into_iter()
        .chain(cfg.host_warnings())
    {
        tracing::warn!("{warning}");
    }
    for (var, near) in crate::config::unknown_env_settings(std::env::vars_os()) {
        match near {
            Some(k) => {
                tracing::warn!("{var} is not a worker setting and is ignored; did you mean {k}?")
            }
            None => tracing::warn!("{var} is not a worker setting and is ignored"),
        }
    }
    // an empty DATABASE_URL is none (as for every command): the config's
    // database_url then (re-check audit: the empty one hid it)
    let url = url
        .clone()
        .filter(|u| !u.trim().is_empty())
        .or(cfg.database_url.clone());
    if let Some(name) = &cfg.name {
        crate::db::name_sessions(&format!("durable worker {name}"));
    }
    // SIGTERM during start-up (probes, the sweep) is a clean stop too
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    let starting = async {
        let db = connect(&url, cfg.db_max_connections, false).await?;
        serve_metrics(&cfg, &db).await?;
        Worker::start(db, cfg)
            .await
            .map_err(|e| CliError::Worker(naming_config(e, &config)))
    };
    // a stop signal during start-up (a database away, a probe that never
    // says hello) stops it at once: it waited out the connect or handshake
    // timeout, up to a day as configured. Nothing was leased yet.
    let worker = tokio::select! {
        w = starting => w,
        () = shutdown.cancelled() => {
            tracing::info!("stop signal during start-up: stopped before leasing anything");
            crate::process::kill_all_groups();
            crate::process::kill_adopted_orphans();
            return Ok(0);
        }
    };
    let worker = match worker {
        Ok(w) => w,
        Err(e) => {
            crate::process::kill_all_groups();
            return Err(e);
        }
    };
    let res = worker.run(shutdown).await;
    WORKER_ENDED.store(true, Ordering::SeqCst);
    // the last line of defence: no child outlives the worker process, not
    // even one that left its process group and cgroup
    crate::process::kill_all_groups();
    crate::process::kill_adopted_orphans();
    res?;
    Ok(0)
}

/// Runs a command that starts executors (`executors`, `conformance`) until
/// it ends or a stop signal arrives: then its executors are killed and its
/// temporary directories removed (they were left in /tmp), exit 128 + the
/// signal.
async fn until_stopped(
    command: impl std::future::Future<Output = Result<u8, CliError>>,
) -> Result<u8, CliError> {
    let stopped = tokio::select! {
        res = command => return res,
        sig = crate::watch::stop_signal() => sig,
    };
    // the command's future is dropped: its temporary directories with it
    crate::process::kill_all_groups();
    eprintln!("stopped by signal {stopped}: its executors were stopped");
    Ok(u8::try_from(128 + stopped).unwrap_or(130))
}

/// `supervisor conformance`: the executor conformance suite.
async fn conformance(
    config: &std::path::Path,
    executor: Option<&str>,
    kinds: &crate::conformance::Kinds,
    json: bool,
) -> Result<u8, CliError> {
    use crate::conformance::{self, ConformanceError};
    let cfg = WorkerConfig::load_for_probe(config)?;
    let reports = conformance::run(&cfg, executor, kinds)
        .await
        .map_err(|e| match e {
            ConformanceError::Spawner(_) => CliError::Other(e.to_string()),
            _ => CliError::Usage(e.to_string()),
        })?;
    if json {
        outln!("{}", conformance::render_json(&reports));
    } else {
        out!("{}", conformance::render(&reports));
    }
    Ok(if reports.iter().all(|r| r.passed()) {
        0
    } else {
        1
    })
}

/// A setup the config decides (an executor's `kinds` list) names its file,
/// as a config error does (audits 90 and 92: "invalid worker setup:
/// executor … kinds = …" did not, in `worker` and `executors` alike).
fn naming_config(e: WorkerError, config: &std::path::Path) -> WorkerError {
    match e {
        WorkerError::Setup(why) => {
            WorkerError::Setup(format!("{why} (config {})", config.display()))
        }
        other => other,
    }
}

/// `supervisor executors`: probes every configured executor.
async fn executors(config: &std::path::Path) -> Result<u8, CliError> {
    let cfg = WorkerConfig::load_for_probe(config)?;
    // what the worker warns of at start, said here too (persistent-pool
    // audit: a one-shot executor's max_jobs_per_process passed silently)
    for ignored in cfg.ignored_settings() {
        eprintln!("warning: {ignored}");
    }
    let spawner = crate::process::Spawner::start().map_err(WorkerError::Spawner)?;
    let mut all_ok = true;
    // a kinds list the worker would refuse is a config error, 2, as there
    let mut misconfigured = false;
    for e in &cfg.executors {
        match crate::worker::probe(&spawner, e, &cfg).await {
            Ok(h) => {
                let routes = crate::worker::routing::routes(&h, e);
                // the worker's own check of the kinds list: a pre-flight
                // check passes where the worker passes (operator audit: a
                // list matching none of the kinds offered passed here, and
                // the worker refused to start)
                // the line still says what the executor offers (what the
                // list should name), and names the error: a script reading
                // stdout alone does not take it for a usable executor
                let refused = crate::worker::check_kinds(e, &h, &routes)
                    .err()
                    .map(|err| naming_config(err, config));
                if let Some(err) = &refused {
                    misconfigured = true;
                    eprintln!("error: {err}");
                }
                let mut leased: Vec<&str> = routes.iter().map(|r| r.kind.as_str()).collect();
                leased.dedup();
                let sdk = [h.sdk_name.as_str(), h.sdk_version.as_str()]
                    .into_iter()
                    .filter(|s| !s.is_empty())
                    .collect::<Vec<_>>()
                    .join(" ");
                outln!(
                    "{}",
                    serde_json::json!({
                        "executor": e.name,
                        "executor_kind": h.executor_kind,
                        "kinds": h.kinds,
                        "leased_kinds": leased,
                        "labels": crate::worker::routing::effective_labels(&h, e),
                        "sdk": sdk,
                        "protocol_version": h.protocol_version,
                        "protocol_versions": h.protocol_versions,
                        "features": h.features,
                        "max_frame_bytes": h.max_frame_bytes,
                        "max_jobs_per_process": jobs_per_process(e, h.max_jobs_per_process),
                        "persistent": e.persistent,
                        "concurrency": e.concurrency,
                        "routes": routes.len(),
                        "error": refused.map(|e| e.to_string()),
                    })
                );
            }
            Err(err) => {
                all_ok = false;
                eprintln!("error: {err}");
                // a line for it too, with what could not be learned null: a
                // script reading stdout sees every entry (docs audit: the
                // one that did not answer was missing from stdout)
                outln!(
                    "{}",
                    serde_json::json!({
                        "executor": e.name,
                        "executor_kind": null,
                        "kinds": null,
                        "leased_kinds": null,
                        "labels": null,
                        "sdk": null,
                        "protocol_version": null,
                        "protocol_versions": null,
                        "features": null,
                        "max_frame_bytes": null,
                        "max_jobs_per_process": null,
                        "persistent": e.persistent,
                        "concurrency": e.concurrency,
                        "routes": 0,
                        "error": err.to_string(),
                    })
                );
            }
        }
    }
    Ok(if misconfigured {
        2
    } else if all_ok {
        0
    } else {
        1
    })
}

/// Runs a worker with the bundled executors; optionally submits a spec and
/// stops once nothing is left to do.
async fn dev_session(
    url: Option<String>,
    cfg: WorkerConfig,
    spec: Option<serde_json::Value>,
    exit_when_idle: bool,
    watch: bool,
) -> Result<u8, CliError> {
    let db = connect(&url, cfg.db_max_connections, false).await?;
    // dev owns its database: it migrates (a plain worker does not)
    db.migrate().await?;
    let shutdown = CancellationToken::new();
    spawn_signal_handler(shutdown.clone());
    serve_metrics(&cfg, &db).await?;
    // the spec first: one refused (exit 2) leaves no worker registered
    // behind it, which `status` took for a live one for 30 s (operator audit)
    let mut run_id = None;
    if let Some(spec) = spec {
        let submitted = db.submit_telling(&spec).await?;
        let id = submitted.id;
        if let Some(note) = known_key_note(&spec, &submitted) {
            eprintln!("{note}");
        }
        print_submitted(id, &serde_json::json!({ "run_id": id }).to_string())?;
        run_id = Some(id);
    }
    let worker = Worker::start(db.clone(), cfg).await?;
    // set when dev stops because nothing is left to run (not a signal)
    let idle = Arc::new(AtomicBool::new(false));
    let watcher = run_id.filter(|_| watch).map(|id| {
        spawn_dev_view(
            db.clone(),
            id,
            shutdown.clone(),
            idle.clone(),
            exit_when_idle,
        )
    });
    let left_open = Arc::new(Mutex::new(Vec::<String>::new()));
    if exit_when_idle {
        spawn_idle_stop(
            db.clone(),
            worker.id(),
            shutdown.clone(),
            idle.clone(),
            left_open.clone(),
        );
    }
    let res = worker.run(shutdown).await;
    WORKER_ENDED.store(true, Ordering::SeqCst);
    crate::process::kill_all_groups();
    let print_left_open = || {
        for line in left_open.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            eprintln!("{line}");
        }
    };
    if let Some(w) = watcher {
        // the worker stopped: the view closes (a last frame when the run
        // ended), then the open steps are named below it
        if tokio::time::timeout(std::time::Duration::from_secs(2), w)
            .await
            .is_err()
        {
            tracing::warn!("the watch view did not finish");
        }
        print_left_open();
        res?;
        return Ok(0);
    }
    print_left_open();
    res?;
    if let Some(id) = run_id {
        let st = db.status(id).await?;
        eprintln!("run {} {:?}: {}", st.run_id, st.name, st.state);
        for s in &st.steps {
            eprintln!("  {:<24} {:<17} attempt {}", s.name, s.state, s.attempt);
        }
    }
    Ok(0)
}

/// On a terminal, dev shows its run as `watch` does (logs: ./.dev/dev.log)
/// until it ends or the worker stops (the view is closed then, before
/// anything else is printed: the cursor was left hidden, and lines printed
/// beside it were drawn over).
fn spawn_dev_view(
    db: Db,
    id: Uuid,
    stop: CancellationToken,
    idle: Arc<AtomicBool>,
    exit_when_idle: bool,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let opts = crate::watch::WatchOptions::for_stdout(false);
        let (idle_seen, interval) = (idle.clone(), opts.interval);
        let stopped = async move {
            stop.cancelled().await;
            if idle_seen.load(Ordering::SeqCst) {
                // dev stops because nothing is left to run: the run has
                // most likely just ended, and the view's next look (within
                // an interval) draws its last frame and ends the view; the
                // stop raced it, and the view closed on the frame before
                tokio::time::sleep(interval * 2).await;
            }
            0
        };
        let end = crate::watch::watch(&db, id, &mut std::io::stdout(), &opts, stopped).await;
        match end {
            Ok(crate::watch::WatchEnd::Terminal(_)) if !exit_when_idle => {
                eprintln!("the worker keeps running (Ctrl-C stops it); logs: .dev/dev.log");
            }
            Ok(crate::watch::WatchEnd::Interrupted(_)) if !idle.load(Ordering::SeqCst) => {
                eprintln!(
                    "stopping: running steps may finish first (a second Ctrl-C stops them now); logs: .dev/dev.log"
                );
            }
            _ => {}
        }
    })
}

/// `dev --exit-when-idle`: stops the worker once nothing runs and nothing it
/// can run is left. Steps only other executors can run would keep it
/// waiting for ever: they are named in `left_open` (printed once the view is
/// closed).
fn spawn_idle_stop(
    db: Db,
    worker_id: Uuid,
    stop: CancellationToken,
    idle: Arc<AtomicBool>,
    left_open: Arc<Mutex<Vec<String>>>,
) {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            match db.work_for(worker_id).await {
                Ok(w) if w.steps == 0 => {
                    *left_open.lock().unwrap_or_else(|p| p.into_inner()) = w
                        .stuck
                        .iter()
                        .map(|s| {
                            format!(
                                "left open: run {} step {:?} ({}): no executor of this worker runs it",
                                s.run_id,
                                s.step,
                                s.needs()
                            )
                        })
                        .collect();
                    tracing::info!("nothing left to run: stopping");
                    idle.store(true, Ordering::SeqCst);
                    stop.cancel();
                    return;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "cannot count the work left"),
            }
        }
    });
}

/// `/metrics`, `/healthz` and `/readyz` when `metrics_addr` is set (before
/// the worker starts: `/healthz` answers while the executors are probed).
async fn serve_metrics(cfg: &WorkerConfig, db: &Db) -> Result<(), CliError> {
    let Some(addr) = cfg.metrics_addr.as_deref() else {
        return Ok(());
    };
    let addr = crate::config::parse_metrics_addr(addr)
        .map_err(|m| CliError::Config(ConfigError::Invalid(m)))?;
    crate::metrics::serve(addr, db)
        .await
        .map_err(|e| CliError::Other(e.to_string()))?;
    Ok(())
}

/// A spec's text as JSON; the error says where it is not.
/// A spec's text as JSON, as deep as `durable.submit_run` takes an input (the
/// spec around it takes three levels: the spec, `steps`, the step); deeper is
/// refused here, exit 2.
fn parse_spec(text: &str) -> Result<serde_json::Value, CliError> {
    use crate::json::{self, ParseError, MAX_VALUE_DEPTH};
    let spec = json::parse_bounded(text.as_bytes(), MAX_VALUE_DEPTH + 3).map_err(|e| match e {
        ParseError::TooDeep { depth, max } => CliError::BadSpec(format!(
            "the spec is nested {depth} levels deep, more than the {max} allowed: an input \
             nests at most {MAX_VALUE_DEPTH} levels (the spec, `steps` and its step take three \
             more); flatten it, or pass deeply structured data as an artifact"
        )),
        ParseError::Json(e) => CliError::NotJson(explain_json_error(&e)),
    })?;
    if let Some(dup) = json::duplicate_key(text.as_bytes()) {
        return Err(CliError::BadSpec(format!(
            "{dup}: a key may come once in an object (the database would keep the last value alone)"
        )));
    }
    Ok(spec)
}

/// serde_json's message, with what it leaves unsaid where it says little:
/// an escape of a lone UTF-16 surrogate (`"\ud800"`) reads "unexpected end
/// of hex escape" although the escape is whole (workflow audit).
fn explain_json_error(e: &serde_json::Error) -> String {
    let text = e.to_string();
    if text.contains("hex escape") || text.contains("surrogate") {
        return format!(
            "{text} (a \\u escape is four hex digits, and one in \\uD800-\\uDBFF must be followed at once by \\uDC00-\\uDFFF: \
             a lone surrogate is no character and JSON text cannot carry one; write the character itself or its whole pair)"
        );
    }
    text
}

fn read_input(file: &str) -> Result<String, CliError> {
    // a UTF-8 byte-order mark (some editors write one) is not part of the JSON
    read_raw_input(file).map(|s| match s.strip_prefix('\u{feff}') {
        Some(rest) => rest.to_owned(),
        None => s,
    })
}

/// The most of a spec's text `submit` reads: a spec is at most 16 MiB as
/// PostgreSQL stores it, and its file may be larger by its indentation. More
/// is refused without reading it all (`submit /dev/zero` read until the
/// machine's memory ran out; audit of the operator's tools).
const MAX_SPEC_INPUT: u64 = 64 * 1024 * 1024;

/// What to do about a spec file that cannot be read (audit 87: a path
/// that does not exist said so and no more).
fn read_hint(e: &std::io::Error) -> &'static str {
    match e.kind() {
        std::io::ErrorKind::NotFound => {
            ": give the path of a workflow spec (a JSON file), or - to read it from stdin"
        }
        std::io::ErrorKind::PermissionDenied => {
            ": make the file readable by this user, or pipe it in with -"
        }
        std::io::ErrorKind::IsADirectory => ": give the path of a spec file, not a directory",
        std::io::ErrorKind::NotADirectory => {
            ": a part of the path before the file's name is a file, not a directory: give the path of a spec file"
        }
        _ => "",
    }
}

fn read_raw_input(file: &str) -> Result<String, CliError> {
    let (path, reader): (&str, Box<dyn Read>) = if file == "-" {
        ("stdin", Box::new(std::io::stdin()))
    } else {
        let f = std::fs::File::open(file).map_err(|source| CliError::Read {
            path: file.to_owned(),
            source,
        })?;
        (file, Box::new(f))
    };
    let mut bytes = Vec::new();
    reader
        .take(MAX_SPEC_INPUT + 1)
        .read_to_end(&mut bytes)
        .map_err(|source| CliError::Read {
            path: path.to_owned(),
            source,
        })?;
    if bytes.len() as u64 > MAX_SPEC_INPUT {
        return Err(CliError::BadSpec(format!(
            "{path} is larger than {} MiB; a spec is at most 16 MiB as stored: pass large \
             data as an artifact",
            MAX_SPEC_INPUT / (1024 * 1024)
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        CliError::BadSpec(format!(
            "{path} is not UTF-8 text: the byte at offset {at} (0x{:02x}) is not valid UTF-8; \
             a spec is JSON, which is UTF-8",
            e.as_bytes().get(at).copied().unwrap_or(0)
        ))
    })
}

/// `gc`: the first SIGINT/SIGTERM ends the pass after its current batch
/// (each batch is its own transaction, so nothing is left half done).
fn spawn_interrupt_handler(token: CancellationToken) {
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        eprintln!("stopping after the current batch");
        token.cancel();
    });
}

/// Set once the worker's run (its drain included) has returned: a later
/// signal has nothing left to force, and the command exits with its own
/// code. A third signal that raced a drain that had just finished logged
/// "the forced stop did not finish" and exited 1 (deployment audit).
static WORKER_ENDED: AtomicBool = AtomicBool::new(false);

/// How long a forced stop (a second signal) may take to give the steps back
/// before the process kills every executor and exits 1 (a third signal does
/// that at once).
const FORCED_EXIT_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

fn spawn_signal_handler(token: CancellationToken) {
    // noted in the handler itself, before the task below runs: the lease
    // loop stops at once (worker::note_stop_signal)
    // SIGHUP too: a closed terminal or ssh session drains the worker
    // instead of killing it on the spot (its steps waited for their leases
    // to expire, its children for the next incarnation's sweep)
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: the action is one atomic store, which is async-signal-safe
        if let Err(e) =
            unsafe { signal_hook_registry::register(sig, crate::worker::note_stop_signal) }
        {
            tracing::error!(signal = sig, error = %e, "cannot install the stop-signal flag");
        }
    }
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let (Ok(mut term), Ok(mut int), Ok(mut hup)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
            signal(SignalKind::hangup()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: draining"),
            _ = int.recv() => tracing::info!("SIGINT: draining"),
            _ = hup.recv() => tracing::info!("SIGHUP (the terminal closed?): draining"),
        }
        token.cancel();
        // a second signal stops children at once
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        // the drain stops every attempt now, without graces, and gives the
        // steps back (uncounted); if that cannot finish (a database that does
        // not answer), the last resort after a few seconds
        if WORKER_ENDED.load(Ordering::SeqCst) {
            return;
        }
        tracing::warn!("second signal: stopping all executors now");
        crate::worker::force_stop();
        tokio::select! {
            _ = tokio::time::sleep(FORCED_EXIT_AFTER) => {}
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        if WORKER_ENDED.load(Ordering::SeqCst) {
            return;
        }
        tracing::warn!("the forced stop did not finish: killing every executor and exiting");
        crate::worker::log_abandoned_attempts();
        crate::process::kill_all_groups();
        std::process::exit(1);
    });
}

/// The repository root: where the bundled executors live. The build's own
/// source tree when it still exists, else the working directory.
pub fn repo_root() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    if built.join("executors-go").is_dir() {
        built.canonicalize().unwrap_or(built)
    } else {
        std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."))
    }
}

/// The worker config of `supervisor dev`: the two bundled demo executors.
pub fn dev_config(root: &Path) -> WorkerConfig {
    let mut cfg = WorkerConfig {
        name: Some("dev".into()),
        ..WorkerConfig::default()
    };
    let go = ExecutorConfig {
        name: "go-demo".into(),
        command: root
            .join("target/executors/demo-executor-go")
            .to_string_lossy()
            .into_owned(),
        // the bundled executors stay warm between jobs, one process started
        // ahead, so not even the first job waits for a process start
        persistent: true,
        warm_processes: 1,
        ..ExecutorConfig::default()
    };
    let py = ExecutorConfig {
        name: "python-demo".into(),
        command: root.join(".venv/bin/python").to_string_lossy().into_owned(),
        args: vec![root
            .join("executors-python/demo_executor.py")
            .to_string_lossy()
            .into_owned()],
        persistent: true,
        warm_processes: 1,
        ..ExecutorConfig::default()
    };
    cfg.executors = vec![go, py];
    cfg
}

// ---------------------------------------------------------------------------
// operator output: durations, tables

/// A duration like `30s`, `10m`, `2h`, `3d` (or several: `1h30m`).
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let bad = || {
        format!(
            "{text:?} is not a duration: give a number and a unit (s, m, h or d), like 30s, 10m, 2h, 3d or 1h30m"
        )
    };
    let s = text.trim();
    if s.is_empty() {
        return Err(bad());
    }
    // the shape first (a number before each unit, each unit once, largest
    // first), then the value: "1500ms" is not a duration however large
    let mut parts: Vec<(&str, u64)> = Vec::new();
    let mut from = 0;
    let mut last_unit = u64::MAX;
    for (i, c) in s.char_indices() {
        if c.is_ascii_digit() {
            continue;
        }
        let unit: u64 = match c {
            's' => 1,
            'm' => 60,
            'h' => 3_600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        if i == from {
            return Err(bad());
        }
        if unit >= last_unit {
            return Err(format!(
                "{text:?} is not a duration: give each unit once, largest first, like 1d12h or 1h30m"
            ));
        }
        last_unit = unit;
        parts.push((&s[from..i], unit));
        from = i + 1;
    }
    if from != s.len() {
        return Err(bad());
    }
    let too_long = || format!("{text:?} is too long: at most 100 years");
    let mut total: u64 = 0;
    for (digits, unit) in parts {
        // digits beyond u64 are a number too large, not a typo
        let n: u64 = digits.parse().map_err(|_| too_long())?;
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .filter(|v| *v <= 100 * 365 * 86_400)
            .ok_or_else(too_long)?;
    }
    Ok(std::time::Duration::from_secs(total))
}

/// An error's text for the terminal: it may quote what the user typed or
/// an executor wrote (`--step` of an unknown step), so every control
/// character but a newline or a tab is escaped (security audit: an escape
/// sequence typed as a step name was echoed to the terminal).
fn printable(s: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| crate::terminal::is_unsafe(c) && c != '\n' && c != '\t';
    if !s.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(s);
    }
    std::borrow::Cow::Owned(
        s.chars()
            .map(|c| {
                if unsafe_char(c) {
                    c.escape_debug().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// What `artifact get` says it wrote: the name is an executor's, so it is
/// quoted with its control characters escaped (it was printed as it came,
/// an escape sequence and all; security audit).
fn wrote_line(name: &str, size: i64, sha256: &str, out: &std::path::Path) -> String {
    format!(
        "wrote {} ({size} bytes, sha256 {sha256}) to {}",
        name.escape_debug(),
        out.display().to_string().escape_debug()
    )
}

/// Rows under a header, columns padded to their widest cell (the last is
/// not), in terminal columns: a CJK character or an emoji takes two (counted
/// in characters, a row with one shifted the columns after it; scale audit).
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    use unicode_width::UnicodeWidthStr;
    let mut widths: Vec<usize> = header.iter().map(|h| h.width()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.width());
            }
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for r in std::iter::once(&header).chain(rows.iter()) {
        let mut line = String::new();
        for (i, c) in r.iter().enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                let pad = widths[i].saturating_sub(c.width());
                line.push_str(c);
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// When a step waiting for its next attempt may run: a time to come, or,
/// once it has passed, that it waits for a worker to lease it (a time in the
/// past read as a schedule missed).
fn next_attempt(t: &chrono::DateTime<chrono::Utc>, now: chrono::DateTime<chrono::Utc>) -> String {
    if *t > now {
        format!(" (next attempt at {})", when(t))
    } else {
        format!(" (due since {}: waiting for a worker to lease it)", when(t))
    }
}

fn when(t: &chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%SZ").to_string()
}

fn when_ms(t: &chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

fn percent(f: Option<f64>) -> String {
    match f {
        Some(f) if f.is_finite() => format!("{:.0}%", (f * 100.0).clamp(0.0, 100.0)),
        _ => String::new(),
    }
}

/// `status --json`: [`crate::db::RunStatus`] as it always was, field for
/// field and in its order, each step with its latest progress added under
/// `progress` (left out for a step that reported none).
#[derive(serde::Serialize)]
struct StatusOut<'a> {
    run_id: Uuid,
    name: &'a str,
    state: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    idempotency_key: Option<&'a str>,
    cancel_requested: bool,
    // as `runs --json` and the library's RunStatus write them: always six
    // fractional digits (chrono's default dropped trailing zeros, so one run
    // in a thousand read "…05.219Z" here and "…05.219000Z" there)
    #[serde(serialize_with = "crate::json::utc_micros")]
    created_at: chrono::DateTime<chrono::Utc>,
    #[serde(serialize_with = "crate::json::utc_micros_opt")]
    finished_at: Option<chrono::DateTime<chrono::Utc>>,
    steps: Vec<StepOut<'a>>,
    waiting: &'a [crate::db::WaitingStep],
    /// How many steps are in each state, `waiting` for those not created
    /// yet, as `runs` counts them: a 1,000-step run's picture in one line.
    step_counts: std::collections::BTreeMap<&'a str, usize>,
}

#[derive(serde::Serialize)]
struct StepOut<'a> {
    #[serde(flatten)]
    step: &'a crate::db::StepStatus,
    #[serde(skip_serializing_if = "Option::is_none")]
    progress: Option<&'a crate::db::Progress>,
    /// A step waiting to be leased that no live worker can run: what it
    /// needs of one (`executor_kind "go", kind "demo.echo"`), as the table's
    /// "no live worker offers …" line (time audit: a JSON reader could not
    /// tell a step waiting for its turn from one waiting for a worker).
    #[serde(skip_serializing_if = "Option::is_none")]
    no_live_worker_offers: Option<String>,
    /// A step waiting to be leased whose every offering live worker paused
    /// the executor that would run it (or itself): who, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    offering_workers_paused: Option<&'a [crate::db::PausedBy]>,
}

fn status_json(
    st: &crate::db::RunStatus,
    progress: &std::collections::BTreeMap<Uuid, crate::db::Progress>,
    unroutable: &[crate::db::StuckStep],
    paused: &[crate::db::PausedStep],
) -> String {
    // tests/tests/cli_inspect.rs checks that every key of RunStatus is here
    let crate::db::RunStatus {
        run_id,
        name,
        state,
        idempotency_key,
        cancel_requested,
        created_at,
        finished_at,
        steps,
        waiting,
        ..
    } = st;
    let out = StatusOut {
        run_id: *run_id,
        name,
        state,
        idempotency_key: idempotency_key.as_deref(),
        cancel_requested: *cancel_requested,
        created_at: *created_at,
        finished_at: *finished_at,
        steps: steps
            .iter()
            .map(|step| StepOut {
                step,
                progress: progress.get(&step.step_run_id),
                no_live_worker_offers: unroutable
                    .iter()
                    .find(|u| u.step == step.name)
                    .map(crate::db::StuckStep::needs),
                offering_workers_paused: paused
                    .iter()
                    .find(|p| p.step.step == step.name)
                    .map(|p| p.paused_by.as_slice()),
            })
            .collect(),
        waiting,
        step_counts: step_counts(st),
    };
    serde_json::to_string_pretty(&out).unwrap_or_default()
}

/// Steps by state (states without a step left out), the steps not created
/// yet as `waiting`.
fn step_counts(st: &crate::db::RunStatus) -> std::collections::BTreeMap<&str, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for s in &st.steps {
        *counts.entry(s.state.as_str()).or_insert(0) += 1;
    }
    if !st.waiting.is_empty() {
        counts.insert("waiting", st.waiting.len());
    }
    counts
}

/// `status` without `--json`: the run, its steps counted by state, then a
/// table of its steps.
fn status_text(
    st: &crate::db::RunStatus,
    progress: &std::collections::BTreeMap<Uuid, crate::db::Progress>,
) -> String {
    let mut out = format!(
        "run {}  {}  {}{}\n",
        st.run_id,
        cell(&st.name, 80),
        st.state,
        match (st.cancel_requested, st.state.as_str()) {
            (false, _) | (true, "cancelled") => "",
            // an ended run the cancel did not end: its running steps
            // answered first, and their outcomes are kept (outside audit:
            // nothing said the cancel was lost)
            (true, "succeeded") => {
                "  (cancel requested too late: the steps still running then ended first, their outcomes kept)"
            }
            // a failure recorded before the cancel: a cancel requested
            // first wins over every later failure, so the run's failure came
            // first (cancel-race audit: "the steps still running then ended
            // first" beside a running step the cancel did end)
            (true, "failed") => {
                "  (cancel requested after a step had failed: the run keeps that failure; steps still open then were cancelled unless they ended first)"
            }
            (true, _) => "  (cancel requested)",
        }
    );
    out.push_str(&format!("created {}", when(&st.created_at)));
    if let Some(f) = &st.finished_at {
        out.push_str(&format!("  finished {}", when(f)));
    }
    let counts = step_counts(st);
    out.push_str(&format!(
        "\nsteps {}: {}\n\n",
        counts.values().sum::<usize>(),
        counts
            .iter()
            .map(|(state, n)| format!("{n} {state}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let mut rows = Vec::new();
    for s in &st.steps {
        // an earlier attempt's progress says so: a retry that has not
        // reported yet showed its predecessor's as its own (contract audit)
        let p = progress
            .get(&s.step_run_id)
            .map(|p| {
                let earlier = if p.attempt < s.attempt {
                    format!(" (attempt {})", p.attempt)
                } else {
                    String::new()
                };
                format!("{} {}{earlier}", percent(p.fraction), cell(&p.message, 48))
            })
            .unwrap_or_default();
        rows.push(vec![
            cell(&s.name, 40),
            s.state.clone(),
            s.attempt.to_string(),
            p.trim().to_owned(),
            s.error
                .as_ref()
                .map(|e| crate::watch::error_label(&s.state, &cell(&e.code, 40)))
                .unwrap_or_default(),
        ]);
    }
    for w in &st.waiting {
        rows.push(vec![
            cell(&w.name, 40),
            "waiting".into(),
            String::new(),
            cell(&format!("on {}", w.depends_on.join(", ")), 60),
            String::new(),
        ]);
    }
    out.push_str(&table(
        &["STEP", "STATE", "ATTEMPT", "PROGRESS", "ERROR"],
        &rows,
    ));
    let errors: Vec<&crate::db::StepStatus> =
        st.steps.iter().filter(|s| s.error.is_some()).collect();
    if !errors.is_empty() {
        out.push('\n');
        for s in errors {
            if let Some(e) = &s.error {
                out.push_str(&format!(
                    "{}: {}: {}{}{}\n",
                    cell(&s.name, 40),
                    crate::watch::error_label(&s.state, &cell(&e.code, 40)),
                    cell(&e.message, 400),
                    s.next_attempt_at
                        .map(|t| next_attempt(&t, chrono::Utc::now()))
                        .unwrap_or_default(),
                    why_it_ended(s, e)
                ));
            }
        }
    }
    out
}

/// What an ended step's error line leaves out: why a retryable error was
/// not retried (the deadline, the attempts; the DAG audit found a step
/// "retryable" with seven attempts left and no word of its deadline), or
/// that a step whose last attempt failed was then cancelled.
fn why_it_ended(s: &crate::db::StepStatus, e: &crate::db::StepError) -> String {
    let Some(reason) = s.reason.as_deref() else {
        return String::new();
    };
    match s.state.as_str() {
        "terminal_failed" if e.retryable => {
            let why = reason
                .strip_prefix(e.code.as_str())
                .and_then(|r| r.strip_prefix(": "))
                .unwrap_or(reason);
            format!(" (not retried: {})", cell(why, 200))
        }
        "cancelled" if e.code != "CANCELLED" && !reason.starts_with("CANCELLED") => {
            format!(" (then cancelled: {})", cell(reason, 200))
        }
        _ => String::new(),
    }
}

/// `events` without `--json` when there is none: of a step (or run) that
/// has ended, why none will come.
fn no_events_text(st: &crate::db::RunStatus, step: Option<&str>) -> String {
    let step_ended = |s: &crate::db::StepStatus| crate::watch::step_ended(&s.state);
    let run_ended = crate::watch::run_is_terminal(&st.state);
    match step {
        Some(name) => match st.steps.iter().find(|s| s.name == name) {
            Some(s) if step_ended(s) && s.attempt == 0 => {
                format!(
                    "no progress events: step {name} is {} (it never ran)\n",
                    s.state
                )
            }
            Some(s) if step_ended(s) => format!(
                "no progress events: step {name} is {} (attempt {}: its executor sent none)\n",
                s.state, s.attempt
            ),
            // a step whose dependencies never succeeded has no row when its
            // run ends without it
            None if run_ended => {
                format!(
                    "no progress events: step {name} never ran (the run is {})\n",
                    st.state
                )
            }
            _ => "no progress events yet\n".into(),
        },
        None if run_ended => {
            if st.steps.iter().all(|s| s.attempt == 0) {
                format!(
                    "no progress events: the run is {} (no step ran)\n",
                    st.state
                )
            } else {
                format!(
                    "no progress events: the run is {} (its executors sent none)\n",
                    st.state
                )
            }
        }
        None => "no progress events yet\n".into(),
    }
}

/// `events` without `--json`.
fn events_text(events: &[crate::db::EventRow]) -> String {
    if events.is_empty() {
        return "no progress events yet\n".into();
    }
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            vec![
                cell(&e.step, 40),
                e.attempt.to_string(),
                e.sequence.to_string(),
                when_ms(&e.at),
                cell(&e.kind, 24),
                percent(e.fraction),
                if e.checkpoint { "yes" } else { "" }.into(),
                cell(&e.message, 400),
            ]
        })
        .collect();
    table(
        &[
            "STEP",
            "ATTEMPT",
            "SEQ",
            "TIME",
            "KIND",
            "FRACTION",
            "CHECKPOINT",
            "MESSAGE",
        ],
        &rows,
    )
}

/// `runs` without `--json`.
fn runs_text(runs: &[crate::db::RunSummary]) -> String {
    if runs.is_empty() {
        return "no runs match\n".into();
    }
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.run_id.to_string(),
                cell(&r.name, 40),
                r.state.clone(),
                when(&r.created_at),
                r.finished_at.as_ref().map(when).unwrap_or_default(),
                r.steps
                    .iter()
                    .map(|(state, n)| format!("{n} {state}"))
                    .collect::<Vec<_>>()
                    .join(", "),
            ]
        })
        .collect();
    table(
        &["RUN", "NAME", "STATE", "CREATED", "FINISHED", "STEPS"],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lone surrogate escape is named as one, whatever serde_json says of
    /// it (its own words for one at the end of a string: "unexpected end of
    /// hex escape"); other errors pass as they are.
    #[test]
    fn a_lone_surrogate_in_a_spec_is_named() {
        for text in [r#"{"s":"\ud800"}"#, r#"{"s":"\ud800x"}"#, r#"{"\udc00":1}"#] {
            let Err(CliError::NotJson(msg)) = parse_spec(text) else {
                panic!("{text} parsed");
            };
            assert!(msg.contains("lone surrogate"), "{text}: {msg}");
        }
        let Err(CliError::NotJson(msg)) = parse_spec(r#"{"s":1"#) else {
            panic!("a cut spec parsed");
        };
        assert!(!msg.contains("surrogate"), "{msg}");
        assert!(
            parse_spec(r#"{"s":"\ud83d\ude00"}"#).is_ok(),
            "a whole pair"
        );
    }

    /// `status --json` writes its times as `runs --json` does: six
    /// fractional digits, also when they end in zeros.
    #[test]
    fn status_json_times_keep_six_digits() {
        let at = chrono::DateTime::parse_from_rfc3339("2026-12-06T05:50:05.219Z")
            .expect("time")
            .with_timezone(&chrono::Utc);
        let st = crate::db::RunStatus {
            run_id: Uuid::nil(),
            name: "r".into(),
            state: "succeeded".into(),
            idempotency_key: None,
            cancel_requested: false,
            created_at: at,
            finished_at: Some(at),
            steps: vec![],
            waiting: vec![],
        };
        let v: serde_json::Value =
            serde_json::from_str(&status_json(&st, &Default::default(), &[], &[])).expect("json");
        assert_eq!(v["created_at"], "2026-12-06T05:50:05.219000Z");
        assert_eq!(v["finished_at"], "2026-12-06T05:50:05.219000Z");
    }

    /// The header says a cancel was requested while the run is open, and
    /// that it came too late for a run that ended otherwise (outside audit:
    /// a succeeded run with a lost cancel said nothing of it).
    #[test]
    fn the_status_header_says_what_became_of_a_cancel_request() {
        let at = chrono::Utc::now();
        let header = |state: &str, cancel_requested: bool| {
            let st = crate::db::RunStatus {
                run_id: Uuid::nil(),
                name: "r".into(),
                state: state.into(),
                idempotency_key: None,
                cancel_requested,
                created_at: at,
                finished_at: None,
                steps: vec![],
                waiting: vec![],
            };
            status_text(&st, &Default::default())
                .lines()
                .next()
                .unwrap_or_default()
                .to_owned()
        };
        assert!(header("running", true).ends_with("running  (cancel requested)"));
        assert!(header("cancelled", true).ends_with("cancelled"));
        assert!(header("running", false).ends_with("running"));
        let h = header("succeeded", true);
        assert!(
            h.contains("succeeded  (cancel requested too late:") && h.contains("outcomes kept"),
            "{h}"
        );
        let h = header("failed", true);
        assert!(
            h.contains(
                "failed  (cancel requested after a step had failed: the run keeps that failure"
            ),
            "{h}"
        );
    }

    /// A retry's time to come is a schedule; once passed, the step waits
    /// for a worker, and the line says so rather than naming a past time as
    /// the next attempt (routing audit).
    #[test]
    fn a_due_retry_reads_as_waiting_for_a_worker() {
        let t = chrono::DateTime::parse_from_rfc3339("2026-12-05T10:00:00Z")
            .map(|t| t.with_timezone(&chrono::Utc))
            .unwrap();
        let before = t - chrono::Duration::seconds(5);
        let after = t + chrono::Duration::seconds(5);
        assert_eq!(
            next_attempt(&t, before),
            " (next attempt at 2026-12-05 10:00:00Z)"
        );
        assert_eq!(
            next_attempt(&t, after),
            " (due since 2026-12-05 10:00:00Z: waiting for a worker to lease it)"
        );
    }

    /// Columns line up in terminal columns: a name of wide characters (two
    /// columns each) pads as wide as it shows.
    #[test]
    fn a_table_pads_wide_characters_by_their_width() {
        let rows = vec![
            vec!["ラン".to_owned(), "succeeded".to_owned()],
            vec!["abc".to_owned(), "failed".to_owned()],
        ];
        let t = table(&["NAME", "STATE"], &rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines, ["NAME  STATE", "ラン  succeeded", "abc   failed"]);
    }

    /// Each event on one line and no control character of a value reaches
    /// the terminal; the formatter's colours do with `ansi`.
    #[test]
    fn an_error_is_printed_without_control_characters() {
        assert_eq!(printable("plain\nnext\tcol"), "plain\nnext\tcol");
        assert_eq!(
            printable("run x has no step named \"\u{1b}[2Jzz\""),
            "run x has no step named \"\\u{1b}[2Jzz\""
        );
    }

    #[test]
    fn artifact_get_escapes_the_name_it_wrote() {
        let line = wrote_line(
            "a\u{1b}[31m\n\r\tb",
            1,
            "ab",
            std::path::Path::new("/tmp/o\u{1b}]0;T\u{7}ut"),
        );
        assert_eq!(
            line,
            "wrote a\\u{1b}[31m\\n\\r\\tb (1 bytes, sha256 ab) to /tmp/o\\u{1b}]0;T\\u{7}ut"
        );
        assert!(!line.chars().any(char::is_control), "{line}");
    }

    #[test]
    fn a_log_event_is_one_line_without_control_characters() {
        let w = |b: &str, ansi: bool| {
            String::from_utf8(one_line(b.as_bytes(), ansi).into_owned()).expect("utf-8")
        };
        assert_eq!(w("plain\ttext é\n", false), "plain\ttext é\n");
        assert_eq!(w("a\nb\r\nc\n", false), "a\\nb\\r\\nc\n");
        assert_eq!(
            w(
                "code=C\x1b[31mX sdk=\x1b]0;TITLE\x07 \u{85}\u{2028}\u{7f}\n",
                false
            ),
            "code=C\\x1b[31mX sdk=\\x1b]0;TITLE\\x07 \\u0085\\u2028\\u007f\n"
        );
        // with colours: the formatter's SGR kept, anything else escaped
        assert_eq!(
            w("\x1b[2mINFO\x1b[0m x=\x1b[2J\x1b]0;T\x07\n", true),
            "\x1b[2mINFO\x1b[0m x=\\x1b[2J\\x1b]0;T\\x07\n"
        );
        assert_eq!(
            w(
                "\x1b[32m INFO\x1b[0m e=\x1b[8mhidden\x1b[38;5;196mred\x1b[30;40m\n",
                true
            ),
            "\x1b[32m INFO\x1b[0m e=\\x1b[8mhidden\\x1b[38;5;196mred\\x1b[30;40m\n"
        );
        // bidirectional overrides and marks
        assert_eq!(
            w("a\u{202e}b\u{200e}c\u{2067}d\n", false),
            "a\\u202eb\\u200ec\\u2067d\n"
        );
        assert!(matches!(
            one_line(b"clean line\n", false),
            std::borrow::Cow::Borrowed(_)
        ));
        // a line of the json format stays JSON, its strings' values the same
        let json_line = "{\"message\":\"a\u{2028}b\u{85}c\u{202e}d\u{7f}e\"}\n";
        let v: serde_json::Value = serde_json::from_str(&w(json_line, false)).expect("still JSON");
        assert_eq!(v["message"], "a\u{2028}b\u{85}c\u{202e}d\u{7f}e");
    }

    #[test]
    fn durations() {
        let secs = |s: &str| parse_duration(s).map(|d| d.as_secs());
        assert_eq!(secs("30s"), Ok(30));
        assert_eq!(secs("10m"), Ok(600));
        assert_eq!(secs("2h"), Ok(7_200));
        assert_eq!(secs("3d"), Ok(259_200));
        assert_eq!(secs("1h30m"), Ok(5_400));
        assert_eq!(secs("0s"), Ok(0));
        for bad in ["", "10", "m", "10x", "-5m", "1.5h", "10 m", "h1"] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(
                e.contains(&format!("{bad:?}")) && e.contains("like 30s"),
                "{e}"
            );
        }
        // a unit never accepted is "not a duration", whatever the number
        for ms in ["1500ms", "99999999999999999999999ms"] {
            assert!(
                parse_duration(ms).expect_err(ms).contains("not a duration"),
                "{ms}"
            );
        }
        for typo in ["1d2d", "30m1h", "1h1h"] {
            let e = parse_duration(typo).expect_err(typo);
            assert!(e.contains("each unit once, largest first"), "{e}");
        }
        assert_eq!(secs("1d12h30m15s"), Ok(86_400 + 12 * 3_600 + 30 * 60 + 15));
        // more digits than any u64: too long, not "not a duration"
        for huge in ["99999999999999999999d", "99999999999999999999s"] {
            assert!(
                parse_duration(huge).expect_err(huge).contains("too long"),
                "{huge}"
            );
        }
        assert!(parse_duration("36600000d")
            .expect_err("long")
            .contains("too long"));
    }

    #[test]
    fn a_log_event_stays_on_one_line() {
        use std::io::Write;
        let mut w = OneLine {
            inner: Vec::new(),
            ansi: false,
        };
        w.write_all(b"WARN the attempt failed error=oops\n2026 INFO forged\r\n")
            .unwrap();
        w.write_all(b"INFO plain\n").unwrap();
        assert_eq!(
            String::from_utf8(w.inner).unwrap(),
            "WARN the attempt failed error=oops\\n2026 INFO forged\\r\nINFO plain\n"
        );
    }

    #[test]
    fn many_steps_waiting_for_the_same_are_one_line() {
        let stuck = |step: &str, kind: &str| crate::db::StuckStep {
            run_id: Uuid::nil(),
            step: step.into(),
            executor_kind: "go".into(),
            kind: kind.into(),
            labels: serde_json::json!({}),
        };
        let mut steps: Vec<_> = (1..=7).map(|i| stuck(&format!("s{i}"), "wide")).collect();
        steps.push(stuck("lone", "other"));
        let text = unroutable_text(&steps);
        assert_eq!(
            text,
            "7 steps (s1, s2, s3, s4, s5, …): no live worker offers executor_kind \"go\", kind \"wide\": they wait for one\n\
             lone: no live worker offers executor_kind \"go\", kind \"other\": it waits for one\n"
        );
    }

    #[test]
    fn cells_and_tables() {
        assert_eq!(cell("a\nb\tc", 10), "a b c");
        assert_eq!(cell("abcdef", 4), "abc…");
        let t = table(&["A", "BB"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "A    BB\nxxx  y\n");
        assert_eq!(percent(Some(0.421)), "42%");
        assert_eq!(percent(None), "");
        assert_eq!(percent(Some(f64::NAN)), "");
    }
}
