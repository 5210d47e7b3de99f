//! The process runtime the producer, consumer and relay share: logging, the readiness line,
//! serving with health and reflection, authentication, shutdown, and the group-commit writer
//! thread. Nothing here crosses the wire; that is `proto`.

pub mod auth;
pub mod group;
pub mod serve;
