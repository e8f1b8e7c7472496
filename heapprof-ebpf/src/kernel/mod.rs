//! Kernel mode: the `kmem:*` tracepoints into per-stack kernel heap counters.
//!
//! Every field is read at the offset the daemon found in the event's tracefs format
//! file (`KERNEL_CONFIG`), so neither BTF nor kernel headers are needed and the
//! layouts of 5.10, 6.1 and later kernels all work with one object.
//!
//! The rooms, by job: `alloc` (the allocation programs), `free` (the free programs:
//! tracepoints, and the raw tracepoints' pairs of copies), `deferred` (frees no
//! tracepoint shows: `kvfree_call_rcu`, bulk frees), `live_objects` (the objects
//! tracked until freed, and when sampling their counts in user mode's filter,
//! `LIVE_FILTER`), `sites` (sites, their counters and stacks), `record` (reading an
//! event's record), `traced` (which processes count) and `config` (what the daemon
//! sets before loading).
//!
//! Map capacities are placeholders: the daemon sets them from its flags before
//! loading.

mod alloc;
mod config;
mod deferred;
mod free;
mod live_objects;
mod record;
mod sites;
mod traced;
