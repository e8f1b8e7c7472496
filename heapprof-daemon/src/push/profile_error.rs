//! Why the push cannot read a written profile: its own room, below every reader
//! (`wire`, `scan`, `processes`, `series`, `otlp`), so that none imports another
//! for it.

use thiserror::Error;

/// A written profile the push cannot read (to split it, or to translate it).
#[derive(Debug, Error)]
pub enum ProfileError {
    /// Not gzip.
    #[error("the profile is not gzip'd: {0}")]
    Gzip(std::io::Error),
    /// Not a profile.
    #[error("the profile does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    /// Cut short, or not protobuf.
    #[error("the profile is cut short or malformed: {0}")]
    Malformed(&'static str),
}
