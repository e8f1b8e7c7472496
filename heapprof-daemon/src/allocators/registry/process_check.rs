//! Reading a process for its allocators: which object serves its `malloc` (the preload
//! library, an allocator library, the program), what to probe there and in its other
//! objects, and the notes when its allocator cannot be seen.

use std::sync::Arc;

use aya::Ebpf;

use super::{AllocatorProbes, ProcessView, another_sessions_library};
use crate::{
    allocators::{api::Family, serving},
    environ::Environ,
    procmaps::{ObjectFile, is_valgrind_tool},
    system_preload::opt_out,
};

/// What a process's `malloc` binds to, read from its objects in binding order.
enum MallocBinding {
    /// heapprofd's preload library (its file's identity) serves the standard names.
    Preload((u64, u64)),
    /// Probes serve them.
    Probes {
        /// The object defining the `malloc` that calls bind to, if any.
        serving: Option<Arc<ObjectFile>>,
        /// If its program is a static binary: whether it has a symbol table.
        static_program: Option<bool>,
    },
}

impl AllocatorProbes {
    /// Finds the allocators of a process and probes those not probed yet: every
    /// function of the object its `malloc` binds to, and the vendor and custom
    /// functions of all its objects. Says once when its allocator cannot be seen.
    pub fn check_process(&mut self, ebpf: &mut Ebpf, process: &ProcessView<'_>) {
        let environ = Environ::of(process.pid);
        let preloads = serving::preloads(process.pid, environ.as_ref());
        let order = serving::binding_order(process.objects, process.exe, &preloads);
        let preload_id = self.preload.as_ref().map(|(_, id)| *id);
        // heapprofd's library is first in the LD_PRELOAD it sets (the environment may
        // be unreadable, or changed since): after the program, it binds first.
        let preload_mapped = preload_id.filter(|id| process.objects.iter().any(|o| o.id == *id));
        let only = self.probed_alone(process.pid);
        let system = self.settings.per_process.is_some();
        if only.is_some() && self.leaves_alone(process, environ.as_ref(), system) {
            return;
        }
        // The system-wide library serves a process only once it has joined it; until
        // its start has asked (it asks before the program's main), nothing is probed.
        // Launch mode's library serves whatever maps it, from its start.
        let preload_mapped = match (system, preload_mapped) {
            (true, Some(id))
                if crate::system_preload::contains(&self.system_joined, process.pid) =>
            {
                Some(id)
            }
            (true, Some(_)) if !process.settled => return,
            (true, _) => None,
            (false, mapped) => mapped,
        };
        let (serving_object, static_program) =
            match self.malloc_binding(process, &order, preload_mapped, preload_id) {
                MallocBinding::Preload(id) => {
                    // The preload library serves the standard names: probe the rest only.
                    self.probe_others(ebpf, process, preload_id);
                    self.serving.insert(process.pid, id);
                    return;
                }
                MallocBinding::Probes {
                    serving,
                    static_program,
                } => (serving, static_program),
            };
        self.probe_objects(ebpf, process, serving_object.as_deref(), preload_id, only);
        if let Some(object) = &serving_object {
            self.serving.insert(process.pid, object.id);
            self.note_preload_fallback(process, preload_id);
            return;
        }
        self.note_unseen_allocator(process, static_program);
    }

    /// Whether heapprofd leaves a process it would probe alone untouched: it runs under
    /// valgrind; or, under the system-wide preload (`system`), it opted out of the
    /// preload or has not been asked to join yet. Says so once where that is news.
    fn leaves_alone(
        &mut self,
        process: &ProcessView<'_>,
        environ: Option<&Environ>,
        system: bool,
    ) -> bool {
        if process.exe.is_some_and(is_valgrind_tool) {
            // Valgrind runs the program's code by translating it: a probe's breakpoint
            // would stop it with SIGTRAP. (With probes for every process there is no
            // such choice; this mode has one.)
            let program = process.exe.unwrap_or(process.comm).to_owned();
            self.report(
                &program,
                format!(
                    "pid {} ({}): runs under valgrind, whose translation would stop at a \
                     probe's breakpoint: heapprofd leaves it alone",
                    process.pid, process.comm
                ),
            );
            return true;
        }
        if !system {
            return false;
        }
        // Opted out of the system-wide preload: its copy never asks, and its probes would
        // make it trap for a profile it declined (another heapprofd may serve it). (A
        // launched command opts out of other sessions' preload, for this one.)
        if environ.is_some_and(opt_out::opts_out) {
            if self.opted_out.insert(process.pid) {
                log::info!(
                    "pid {} ({}): opted out of the system-wide preload ({}={}): heapprofd \
                     leaves it alone",
                    process.pid,
                    process.comm,
                    heapprof_common::preload::SYSTEM_OPT_OUT_ENV,
                    heapprof_common::preload::SYSTEM_OPT_OUT_VALUE
                );
            }
            return true;
        }
        // A process that ran before heapprofd, not asked yet: its join comes, or its
        // probes do if it cannot be asked.
        self.awaiting_ask.contains(&process.pid)
    }

    /// Walks a process's objects in binding `order` (scanning each) to the first that
    /// serves `malloc`: the preload library if `preload_mapped` and no program binds it
    /// ahead, else the first object defining it. Notes a static program on the way.
    fn malloc_binding(
        &mut self,
        process: &ProcessView<'_>,
        order: &[Arc<ObjectFile>],
        preload_mapped: Option<(u64, u64)>,
        preload_id: Option<(u64, u64)>,
    ) -> MallocBinding {
        let mut static_program = None;
        for object in order {
            if serving::is_loader(object) || another_sessions_library(object, preload_id) {
                continue;
            }
            let executable = process.exe == Some(object.path.as_str());
            if let Some(id) = preload_mapped
                && !executable
            {
                return MallocBinding::Preload(id);
            }
            match self.scan(object, executable) {
                Ok(scan) => {
                    if executable && scan.static_executable {
                        static_program = Some(scan.has_symbol_table);
                    }
                    if scan.defines_malloc {
                        return MallocBinding::Probes {
                            serving: Some(Arc::clone(object)),
                            static_program,
                        };
                    }
                }
                Err(err) => log::debug!("pid {}: {err}", process.pid),
            }
        }
        MallocBinding::Probes {
            serving: None,
            static_program,
        }
    }

    /// Probes a process's objects (for process `only` alone, or for every process):
    /// every allocator function of `serving`, the object its `malloc` binds to, and
    /// the vendor and custom functions of the others.
    fn probe_objects(
        &mut self,
        ebpf: &mut Ebpf,
        process: &ProcessView<'_>,
        serving: Option<&ObjectFile>,
        preload_id: Option<(u64, u64)>,
        only: Option<u32>,
    ) {
        let all = [Family::Standard, Family::Vendor, Family::Custom];
        let others = [Family::Vendor, Family::Custom];
        for object in process.objects {
            if serving::is_loader(object) || another_sessions_library(object, preload_id) {
                continue;
            }
            let serves = serving.is_some_and(|s| s.id == object.id);
            let executable = process.exe == Some(object.path.as_str());
            let families: &[Family] = if serves { &all } else { &others };
            match self.probe_object_for(ebpf, object, families, executable, only) {
                Ok(0) => {}
                Ok(added) => log::debug!(
                    "pid {}: {added} allocator functions of {} probed",
                    process.pid,
                    object.path
                ),
                Err(err) => self.report(
                    &object.path,
                    format!(
                        "pid {} ({}): cannot probe the allocator in {}: {err:#}; heapprofd \
                         does not see its allocations there (name other functions with \
                         --allocator)",
                        process.pid, process.comm, object.path
                    ),
                ),
            }
        }
    }

    /// Says once why no allocator is seen in a process none of whose objects serves
    /// `malloc` (`static_program`: whether its static program has a symbol table), once
    /// it is past loading and no custom function of it is probed instead.
    fn note_unseen_allocator(&mut self, process: &ProcessView<'_>, static_program: Option<bool>) {
        // A dynamic program whose loader has mapped nothing else yet is still loading.
        let loading = static_program.is_none()
            && process
                .objects
                .iter()
                .all(|o| process.exe == Some(o.path.as_str()) || serving::is_loader(o));
        if loading || (!process.settled && static_program.is_none()) {
            return;
        }
        let program = process.exe.unwrap_or(process.comm);
        let uses_custom = process
            .objects
            .iter()
            .any(|o| self.attached.keys().any(|(id, _)| *id == o.id));
        let message = match static_program {
            Some(false) => format!(
                "pid {} ({}): {program} is a static binary without a symbol table \
                 (stripped), so heapprofd cannot find its allocator and counts nothing \
                 in it: profile an unstripped build, or name exported allocator \
                 functions with --allocator",
                process.pid, process.comm
            ),
            Some(true) if uses_custom => return,
            Some(true) => format!(
                "pid {} ({}): {program} is a static binary that defines no malloc \
                 heapprofd knows: name its allocator's functions with --allocator",
                process.pid, process.comm
            ),
            None if uses_custom => return,
            None => format!(
                "pid {} ({}): none of the objects it maps defines malloc, so heapprofd \
                 sees no allocator in it: name its allocator's functions with --allocator",
                process.pid, process.comm
            ),
        };
        self.report(program, message);
    }

    /// Probes the vendor and custom functions of a process's objects (not the preload
    /// library's).
    fn probe_others(
        &mut self,
        ebpf: &mut Ebpf,
        process: &ProcessView<'_>,
        preload_id: Option<(u64, u64)>,
    ) {
        for object in process.objects {
            if serving::is_loader(object)
                || Some(object.id) == preload_id
                || another_sessions_library(object, preload_id)
            {
                continue;
            }
            let executable = process.exe == Some(object.path.as_str());
            // A library defining malloc is the allocator behind the preload library:
            // its vendor functions run inside the calls the library reports (mimalloc's
            // realloc jumps to mi_heap_realloc), and a probe there could not tell.
            let behind = !executable
                && self
                    .scan(object, executable)
                    .is_ok_and(|scan| scan.defines_malloc);
            let families: &[Family] = if behind {
                &[Family::Custom]
            } else {
                &[Family::Vendor, Family::Custom]
            };
            // The system-wide preload and launch mode's descendants: a process's other
            // objects are probed for it alone.
            let only = self.probed_alone(process.pid);
            if let Err(err) = self.probe_object_for(ebpf, object, families, executable, only) {
                log::debug!("pid {}: {}: {err:#}", process.pid, object.path);
            }
        }
    }

    /// Says once per process that the preload library does not serve it, once it is
    /// past its start-up.
    fn note_preload_fallback(&mut self, process: &ProcessView<'_>, preload_id: Option<(u64, u64)>) {
        let system = self.settings.per_process.is_some();
        let descendant = !system && self.probed_alone(process.pid).is_some();
        if (preload_id.is_none() && !descendant)
            || !process.settled
            || !self.preload_fallbacks.insert(process.pid)
        {
            return;
        }
        if system {
            // The system-wide preload: every process running before heapprofd is one.
            log::debug!(
                "pid {} ({}): not served by the system-wide library; probed alone",
                process.pid,
                process.comm
            );
            return;
        }
        let mapped = process.objects.iter().any(|o| Some(o.id) == preload_id);
        let why = match (preload_id, mapped) {
            (None, _) => "--preload off",
            (Some(_), true) => "its program binds malloc ahead of it",
            (Some(_), false) => {
                "the library is not loaded: a static or setuid program, or LD_PRELOAD dropped"
            }
        };
        if descendant {
            // Only the command is held until its probes are on: said once per program,
            // in the log and in the profiles.
            let program = process.exe.unwrap_or(process.comm);
            self.report(
                &format!("launched child {program}"),
                format!(
                    "pid {} ({}), a child of the command: heapprofd's preload library does \
                     not serve {program} ({why}); its allocator's probes are attached for \
                     it once its program is read, and what it allocates before (about a \
                     tenth of a second after its exec) is not counted",
                    process.pid, process.comm
                ),
            );
            return;
        }
        log::info!(
            "pid {} ({}): heapprofd's preload library does not serve it ({why}); its \
             allocator's probes count its calls instead (an entry and a return trap each)",
            process.pid,
            process.comm
        );
    }
}
