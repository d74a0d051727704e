//! The durable workflow runtime's supervisor. See ARCHITECTURE.md for the map.
pub mod artifact_cmd;
pub mod artifacts;
pub mod cli;
pub mod config;
pub mod conformance;
pub mod db;
pub mod dev;
pub mod fault;
pub mod json;
pub mod metrics;
pub mod process;
pub mod retry;
pub mod secrets;
pub mod state;
pub mod watch;
pub mod wire;
pub mod worker;
