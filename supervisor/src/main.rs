use std::process::ExitCode;

use clap::Parser;
use supervisor::cli::{Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    if let Err(msg) = supervisor::cli::check_log_format_env() {
        eprintln!("error: {msg}");
        return ExitCode::from(2);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli.with_database_url_from_env(),
        Err(e) => return supervisor::cli::usage_error(e),
    };
    if runs_executors(&cli.command) {
        start_reaping();
    }
    if only_prints(&cli.command) {
        // a closed pipe ends a printing command quietly, as it does `cat`
        // (`supervisor status ID | head -1`): Rust's runtime ignores
        // SIGPIPE, and println! then panicked on the write (exit 101, a
        // backtrace). Commands with executor children keep ignoring it: a
        // write to a child that died must be an error, not the end.
        // SAFETY: signal() only sets the process's disposition of SIGPIPE
        // back to the default; no handler (no Rust code) is installed.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    supervisor::cli::main_with(cli).await
}

/// The commands that run a worker (and so executor children, and their orphans).
fn runs_executors(command: &Command) -> bool {
    match command {
        Command::Worker {
            print_default_config,
            ..
        } => !print_default_config,
        Command::Dev { print_config, .. } => !print_config,
        _ => false,
    }
}

/// The commands that start no executor: they read the database and print.
/// Not `submit`: its output is the id of a run it made, and a closed pipe
/// killed it silently after the run was made, so a retry made another
/// (re-check audit); it says which run it made instead, exit 1.
fn only_prints(command: &Command) -> bool {
    !matches!(
        command,
        Command::Worker { .. }
            | Command::Dev { .. }
            | Command::Executors { .. }
            | Command::Conformance { .. }
            | Command::Submit { .. }
    )
}

/// Before anything is spawned: orphaned grandchildren of executors are
/// re-parented to this process (as PID 1 of a container they are anyway),
/// and every exited child that is not a tracked executor is reaped, so none
/// is left a zombie. Logging is not set up yet (`main_with` does it): the
/// reaper thread logs its state once it is; a failure here is printed.
fn start_reaping() {
    // before the first large block: one already kept is not given back
    supervisor::process::return_large_frees_to_the_system();
    if let Err(e) = supervisor::process::become_subreaper() {
        eprintln!("warning: {e}; orphans of executors will be re-parented to init");
    }
    if let Err(e) = supervisor::process::start_orphan_reaper() {
        eprintln!("warning: {e}; exited orphans may stay zombies");
    }
}
