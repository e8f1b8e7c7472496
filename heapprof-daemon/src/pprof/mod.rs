//! Go-pprof heap profiles: messages, a validating builder, a crash-safe writer and
//! the output directory's retention.

pub mod builder;
pub mod proto;
pub mod retention;
pub mod writer;

pub use builder::{LabelValue, MappingKey, ProfileBuilder};
