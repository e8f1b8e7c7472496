//! Go-pprof heap profiles: messages, a validating builder, the comments programs key
//! by, a crash-safe writer and the output directory's retention.

pub mod builder;
pub mod keyed_comments;
pub mod proto;
pub mod retention;
pub mod writer;

pub use builder::{LabelValue, MappingKey, ProfileBuilder};
