//! Go-pprof heap profiles: messages, a validating builder and a crash-safe writer.

pub mod builder;
pub mod proto;
pub mod writer;

pub use builder::{LabelValue, MappingKey, ProfileBuilder};
