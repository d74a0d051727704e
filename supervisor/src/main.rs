use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    supervisor::cli::main_with(supervisor::cli::Cli::parse()).await
}
