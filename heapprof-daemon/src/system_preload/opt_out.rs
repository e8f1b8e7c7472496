//! Programs that keep out of the system-wide preload: started with
//! [`SYSTEM_OPT_OUT_ENV`]`=`[`SYSTEM_OPT_OUT_VALUE`], their copy of the library never
//! asks to join, and heapprofd leaves them alone (neither joined nor probed), so that
//! another heapprofd (`--pid`, launch mode) can serve them in-process, or none does.

use heapprof_common::preload::{SYSTEM_OPT_OUT_ENV, SYSTEM_OPT_OUT_VALUE};

use crate::environ::Environ;

/// Whether process `pid` was started with the opt-out in its environment (the one its
/// program got at exec, which is what its copy of the library reads at start). A
/// process whose environment cannot be read is not taken as opted out.
pub fn opted_out(pid: u32) -> bool {
    Environ::of(pid).is_some_and(|environ| opts_out(&environ))
}

/// Whether an environment holds the opt-out.
pub fn opts_out(environ: &Environ) -> bool {
    environ.has(SYSTEM_OPT_OUT_ENV, SYSTEM_OPT_OUT_VALUE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn environ_opts_out(block: &[u8]) -> bool {
        opts_out(&Environ::from_block(block))
    }

    #[test]
    fn only_the_exact_entry_opts_out() {
        assert!(environ_opts_out(
            b"PATH=/bin\0HEAPPROFD_SYSTEM_PRELOAD=off\0HOME=/root"
        ));
        assert!(environ_opts_out(b"HEAPPROFD_SYSTEM_PRELOAD=off"));
        assert!(!environ_opts_out(b"HEAPPROFD_SYSTEM_PRELOAD=on\0"));
        assert!(!environ_opts_out(b"HEAPPROFD_SYSTEM_PRELOAD=offline\0"));
        assert!(!environ_opts_out(b"XHEAPPROFD_SYSTEM_PRELOAD=off\0"));
        assert!(!environ_opts_out(b"HEAPPROFD_SYSTEM_PRELOAD\0"));
        assert!(!environ_opts_out(b""));
    }

    #[test]
    fn this_process_is_not_opted_out() {
        // The test runner's environment has no opt-out (CI sets none).
        assert_eq!(
            opted_out(std::process::id()),
            std::env::var(SYSTEM_OPT_OUT_ENV).as_deref() == Ok(SYSTEM_OPT_OUT_VALUE)
        );
    }
}
