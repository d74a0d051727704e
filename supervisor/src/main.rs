use std::process::ExitCode;

use clap::Parser;
use supervisor::cli::{Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if runs_executors(&cli.command) {
        start_reaping();
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

/// Before anything is spawned: orphaned grandchildren of executors are
/// re-parented to this process (as PID 1 of a container they are anyway),
/// and every exited child that is not a tracked executor is reaped, so none
/// is left a zombie. Logging is not set up yet (`main_with` does it): the
/// reaper thread logs its state once it is; a failure here is printed.
fn start_reaping() {
    if let Err(e) = supervisor::process::become_subreaper() {
        eprintln!("warning: {e}; orphans of executors will be re-parented to init");
    }
    if let Err(e) = supervisor::process::start_orphan_reaper() {
        eprintln!("warning: {e}; exited orphans may stay zombies");
    }
}
