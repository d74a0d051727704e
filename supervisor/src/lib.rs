//! The durable workflow runtime's supervisor. See ARCHITECTURE.md for the map.
pub mod db;
pub mod retry;
pub mod state;
pub mod wire;
