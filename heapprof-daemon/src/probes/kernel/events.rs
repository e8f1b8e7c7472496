//! Which kmem events a session uses, and where the fields kernel mode reads lie in
//! each, from the event's format file in tracefs (no BTF, no kernel headers).

use std::path::Path;

use anyhow::{Context as _, Result, bail};
use heapprof_common::kernel::{EventLayout, FieldRef, KernelEvent};
use thiserror::Error;

use crate::tracefs::{self, EventFormat};

/// Why an event's layout cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    /// The event lacks a field heapprofd needs.
    #[error("{event} has no field `{field}`")]
    MissingField {
        /// `category:name`.
        event: String,
        /// The field.
        field: &'static str,
    },
    /// A field has a size heapprofd cannot read as a number.
    #[error("field `{field}` of {event} is {size} bytes; only 4- or 8-byte fields can be read")]
    BadSize {
        /// `category:name`.
        event: String,
        /// The field.
        field: &'static str,
        /// Its size.
        size: u32,
    },
    /// A field lies beyond what the programs can address.
    #[error("field `{field}` of {event} is at offset {offset}, beyond 65535")]
    BadOffset {
        /// `category:name`.
        event: String,
        /// The field.
        field: &'static str,
        /// Its offset.
        offset: u32,
    },
}

/// Which events a session uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSelection {
    /// Page allocations and frees as well (`--pages`).
    pub pages: bool,
    /// Follow the children of traced processes (a launched command).
    pub follow_forks: bool,
}

/// The fields of `event` that kernel mode reads, located in its format.
pub fn event_layout(event: KernelEvent, format: &EventFormat) -> Result<EventLayout, LayoutError> {
    let qualified = || format!("{}:{}", event.category(), event.name());
    let get = |name: &'static str, required: bool| -> Result<FieldRef, LayoutError> {
        let Some(field) = format.field(name) else {
            return if required {
                Err(LayoutError::MissingField {
                    event: qualified(),
                    field: name,
                })
            } else {
                Ok(FieldRef::default())
            };
        };
        if !matches!(field.size, 4 | 8) {
            return Err(LayoutError::BadSize {
                event: qualified(),
                field: name,
                size: field.size,
            });
        }
        let offset = u16::try_from(field.offset).map_err(|_| LayoutError::BadOffset {
            event: qualified(),
            field: name,
            offset: field.offset,
        })?;
        Ok(FieldRef {
            offset,
            size: field.size as u16,
        })
    };
    let none = FieldRef::default();
    Ok(match event {
        KernelEvent::Kmalloc
        | KernelEvent::KmallocNode
        | KernelEvent::KmemCacheAlloc
        | KernelEvent::KmemCacheAllocNode => EventLayout {
            ptr: get("ptr", true)?,
            call_site: get("call_site", false)?,
            bytes_req: get("bytes_req", false)?,
            bytes_alloc: get("bytes_alloc", true)?,
            order: none,
            // kmalloc's class is its size; kernels before 6.0 have no name here.
            name: if matches!(
                event,
                KernelEvent::KmemCacheAlloc | KernelEvent::KmemCacheAllocNode
            ) {
                get("name", false)?
            } else {
                none
            },
        },
        KernelEvent::Kfree | KernelEvent::KmemCacheFree => EventLayout {
            ptr: get("ptr", true)?,
            call_site: get("call_site", false)?,
            ..EventLayout::default()
        },
        KernelEvent::PageAlloc => EventLayout {
            ptr: get("pfn", true)?,
            order: get("order", true)?,
            ..EventLayout::default()
        },
        KernelEvent::PageFree | KernelEvent::PageFreeBatched => EventLayout {
            ptr: get("pfn", true)?,
            ..EventLayout::default()
        },
        KernelEvent::ProcessFork => EventLayout {
            ptr: get("child_pid", true)?,
            ..EventLayout::default()
        },
    })
}

/// Whether a session must have `event` (an error when missing) or uses it if present.
fn required(event: KernelEvent, selection: EventSelection) -> Option<bool> {
    match event {
        KernelEvent::Kmalloc
        | KernelEvent::KmemCacheAlloc
        | KernelEvent::Kfree
        | KernelEvent::KmemCacheFree => Some(true),
        KernelEvent::KmallocNode | KernelEvent::KmemCacheAllocNode => Some(false),
        KernelEvent::PageAlloc | KernelEvent::PageFree if selection.pages => Some(true),
        KernelEvent::PageFreeBatched if selection.pages => Some(false),
        KernelEvent::ProcessFork if selection.follow_forks => Some(true),
        _ => None,
    }
}

/// The events this kernel offers for `selection`, with their layouts; an error names
/// the first missing or unreadable one.
pub fn resolve_events(
    tracing: &Path,
    selection: EventSelection,
) -> Result<Vec<(KernelEvent, EventLayout)>> {
    if !tracing.join("events/kmem").is_dir() {
        bail!(
            "this kernel has no kmem tracepoints ({} is missing); heapprofd --kernel needs a \
             kernel built with CONFIG_TRACEPOINTS and the kmem events",
            tracing.join("events/kmem").display()
        );
    }
    let mut events = Vec::new();
    for event in KernelEvent::ALL {
        let Some(must) = required(event, selection) else {
            continue;
        };
        match tracefs::event_format(tracing, event.category(), event.name())? {
            Some(format) => {
                let layout = event_layout(event, &format).with_context(|| {
                    format!(
                        "this kernel's layout of {}:{} is not supported",
                        event.category(),
                        event.name()
                    )
                })?;
                events.push((event, layout));
            }
            None if must => bail!(
                "this kernel has no {}:{} tracepoint; heapprofd --kernel cannot count its heap",
                event.category(),
                event.name()
            ),
            None => {}
        }
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(kernel: &str, event: &str) -> EventFormat {
        let path = format!(
            "{}/tests/fixtures/tracefs/{kernel}/{event}.format",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        tracefs::format::parse(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn field(offset: u16, size: u16) -> FieldRef {
        FieldRef { offset, size }
    }

    #[test]
    fn layouts_of_linux_5_10() {
        let kmalloc =
            event_layout(KernelEvent::Kmalloc, &fixture("linux-5.10", "kmalloc")).expect("kmalloc");
        assert_eq!(
            (
                kmalloc.call_site,
                kmalloc.ptr,
                kmalloc.bytes_req,
                kmalloc.bytes_alloc
            ),
            (field(8, 8), field(16, 8), field(24, 8), field(32, 8))
        );
        let node = event_layout(
            KernelEvent::KmallocNode,
            &fixture("linux-5.10", "kmalloc_node"),
        )
        .expect("node");
        assert_eq!(node.bytes_alloc, field(32, 8));
        let cache_node = event_layout(
            KernelEvent::KmemCacheAllocNode,
            &fixture("linux-5.10", "kmem_cache_alloc_node"),
        )
        .expect("cache node");
        assert_eq!(cache_node.ptr, field(16, 8));
        let page = event_layout(
            KernelEvent::PageAlloc,
            &fixture("linux-5.10", "mm_page_alloc"),
        )
        .expect("page");
        assert_eq!((page.ptr, page.order), (field(8, 8), field(16, 4)));
        let fork = event_layout(
            KernelEvent::ProcessFork,
            &fixture("linux-5.10", "sched_process_fork"),
        )
        .expect("fork");
        assert_eq!(fork.ptr, field(44, 4));
        let free = event_layout(
            KernelEvent::KmemCacheFree,
            &fixture("linux-5.10", "kmem_cache_free"),
        )
        .expect("free");
        assert_eq!(free.ptr, field(16, 8));
    }

    #[test]
    fn layouts_of_linux_6_1() {
        let cache = event_layout(
            KernelEvent::KmemCacheAlloc,
            &fixture("linux-6.1", "kmem_cache_alloc"),
        )
        .expect("cache");
        assert_eq!(
            (cache.ptr, cache.bytes_req, cache.bytes_alloc, cache.name),
            (
                field(16, 8),
                field(24, 8),
                field(32, 8),
                FieldRef::default()
            )
        );
        let free = event_layout(
            KernelEvent::KmemCacheFree,
            &fixture("linux-6.1", "kmem_cache_free"),
        )
        .expect("free");
        assert_eq!(free.ptr, field(16, 8));
        let page = event_layout(
            KernelEvent::PageAlloc,
            &fixture("linux-6.1", "mm_page_alloc"),
        )
        .expect("page");
        assert_eq!(page.order, field(16, 4));
    }

    #[test]
    fn layouts_of_linux_6_18() {
        // The cache name (a __data_loc string) moved bytes_req and bytes_alloc back by 8.
        let cache = event_layout(
            KernelEvent::KmemCacheAlloc,
            &fixture("linux-6.18", "kmem_cache_alloc"),
        )
        .expect("cache");
        assert_eq!(
            (cache.ptr, cache.name, cache.bytes_req, cache.bytes_alloc),
            (field(16, 8), field(24, 4), field(32, 8), field(40, 8))
        );
        let kmalloc =
            event_layout(KernelEvent::Kmalloc, &fixture("linux-6.18", "kmalloc")).expect("kmalloc");
        assert_eq!(
            (kmalloc.bytes_req, kmalloc.bytes_alloc),
            (field(24, 8), field(32, 8))
        );
        let fork = event_layout(
            KernelEvent::ProcessFork,
            &fixture("linux-6.18", "sched_process_fork"),
        )
        .expect("fork");
        assert_eq!(fork.ptr, field(20, 4));
        let batched = event_layout(
            KernelEvent::PageFreeBatched,
            &fixture("linux-6.18", "mm_page_free_batched"),
        )
        .expect("batched");
        assert_eq!(batched.ptr, field(8, 8));
    }

    /// A tracing directory holding the given events of a fixture kernel.
    fn tracing_dir(kernel: &str, events: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        for event in events {
            let category = if *event == "sched_process_fork" {
                "sched"
            } else {
                "kmem"
            };
            let event_dir = dir.path().join("events").join(category).join(event);
            std::fs::create_dir_all(&event_dir).expect("mkdir");
            let source = format!(
                "{}/tests/fixtures/tracefs/{kernel}/{event}.format",
                env!("CARGO_MANIFEST_DIR")
            );
            std::fs::copy(&source, event_dir.join("format")).expect("copy fixture");
        }
        dir
    }

    const SLAB_EVENTS: [&str; 4] = ["kmalloc", "kmem_cache_alloc", "kfree", "kmem_cache_free"];

    #[test]
    fn resolves_the_events_a_kernel_offers() {
        let plain = EventSelection {
            pages: false,
            follow_forks: false,
        };
        let mut v5 = SLAB_EVENTS.to_vec();
        v5.extend(["kmalloc_node", "kmem_cache_alloc_node"]);
        let dir = tracing_dir("linux-5.10", &v5);
        let events: Vec<KernelEvent> = resolve_events(dir.path(), plain)
            .expect("5.10 resolves")
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        assert!(events.contains(&KernelEvent::KmallocNode) && events.contains(&KernelEvent::Kfree));

        // 6.1 has no _node events: they are optional.
        let dir = tracing_dir("linux-6.1", &SLAB_EVENTS);
        assert_eq!(
            resolve_events(dir.path(), plain)
                .expect("6.1 resolves")
                .len(),
            4
        );

        // --pages needs the page events; a launched command needs the fork event.
        let all = EventSelection {
            pages: true,
            follow_forks: true,
        };
        let err = resolve_events(dir.path(), all).expect_err("no page events");
        assert!(format!("{err:#}").contains("kmem:mm_page_alloc"), "{err:#}");
        let mut v618 = SLAB_EVENTS.to_vec();
        v618.extend([
            "mm_page_alloc",
            "mm_page_free",
            "mm_page_free_batched",
            "sched_process_fork",
        ]);
        let dir = tracing_dir("linux-6.18", &v618);
        assert_eq!(
            resolve_events(dir.path(), all)
                .expect("6.18 resolves")
                .len(),
            8
        );
    }

    #[test]
    fn missing_or_broken_events_are_named() {
        let plain = EventSelection {
            pages: false,
            follow_forks: false,
        };
        let empty = tempfile::tempdir().expect("temp dir");
        let err = resolve_events(empty.path(), plain).expect_err("no kmem");
        assert!(
            format!("{err:#}").contains("no kmem tracepoints"),
            "{err:#}"
        );

        let dir = tracing_dir("linux-6.18", &["kmalloc", "kfree", "kmem_cache_free"]);
        let err = resolve_events(dir.path(), plain).expect_err("no kmem_cache_alloc");
        assert!(
            format!("{err:#}").contains("no kmem:kmem_cache_alloc tracepoint"),
            "{err:#}"
        );

        let dir = tracing_dir("linux-6.18", &SLAB_EVENTS);
        let format = dir.path().join("events/kmem/kmalloc/format");
        std::fs::write(
            &format,
            "name: kmalloc\nformat:\n\tfield:const void * ptr;\toffset:x;\n",
        )
        .expect("write");
        let err = format!(
            "{:#}",
            resolve_events(dir.path(), plain).expect_err("malformed")
        );
        assert!(
            err.contains("kmalloc/format is not a valid tracepoint format file")
                && err.contains("line 3"),
            "{err}"
        );
    }

    #[test]
    fn a_layout_without_the_needed_fields_is_refused() {
        let kfree = fixture("linux-6.18", "kfree");
        assert_eq!(
            event_layout(KernelEvent::Kmalloc, &kfree),
            Err(LayoutError::MissingField {
                event: "kmem:kmalloc".into(),
                field: "bytes_alloc"
            })
        );
        let comm_as_pid = tracefs::format::parse(
            "name: sched_process_fork\nformat:\n\tfield:char child_pid[16];\toffset:8;\tsize:16;\tsigned:0;\n",
        )
        .expect("parses");
        assert!(matches!(
            event_layout(KernelEvent::ProcessFork, &comm_as_pid),
            Err(LayoutError::BadSize { size: 16, .. })
        ));
    }
}
