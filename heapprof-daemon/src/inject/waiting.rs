//! Which thread of the process heapprofd borrows for its calls: one that `/proc`
//! shows waiting in a system call where it holds no allocator, loader or stdio lock,
//! and not inside a signal handler (which may have interrupted such a lock's holder).

use std::time::Duration;

use super::{NotJoined, not_joined, tracee};

/// Holds a thread of `pid` that is waiting in a system call: tries each thread `/proc`
/// shows waiting, a few rounds.
pub(super) fn hold_waiting_thread(pid: u32, restorer: u64) -> Result<tracee::Tracee, NotJoined> {
    let mut last_error = None;
    let mut in_handler = false;
    for round in 0..20 {
        if round > 0 {
            std::thread::sleep(Duration::from_millis(25));
        }
        for candidate in candidate_threads(pid) {
            match tracee::Tracee::seize(pid, candidate.tid) {
                // Still in the call /proc showed (or just back from it): its first
                // argument is known for a restart.
                Ok(thread) if in_signal_handler(&thread, restorer) => in_handler = true,
                Ok(mut thread)
                    if thread.syscall() == Some((candidate.number, candidate.second)) =>
                {
                    thread.set_first_argument(candidate.first);
                    return Ok(thread);
                }
                // It went on meanwhile: given back, another try.
                Ok(thread) => drop(thread),
                Err(err) => last_error = Some(err),
            }
        }
    }
    Err(not_joined(match last_error {
        Some(err) => format!("cannot hold a thread of it with ptrace: {err}"),
        None if in_handler => "its threads that wait in a system call wait inside a signal \
                               handler, which may hold the allocator's or the loader's lock"
            .to_owned(),
        None => "none of its threads waited in a system call (it computes without pause), \
                 where heapprofd could call into it safely"
            .to_owned(),
    }))
}

/// How far above its stack pointer a thread's stack is searched for a signal frame.
const HANDLER_SEARCH_BYTES: u64 = 64 * 1024;

/// Whether the held thread waits inside a signal handler: the handler's return
/// address, the C library's restorer, is on its stack above the stack pointer. Such a
/// thread waits in a system call, but the handler may have interrupted it inside
/// malloc or the loader, holding their locks: a `dlopen` there would deadlock it and
/// leave the loader locked for the whole process (found by the injection stress test).
fn in_signal_handler(thread: &tracee::Tracee, restorer: u64) -> bool {
    if restorer == 0 {
        return false;
    }
    let mut address = thread.stack_pointer() & !7;
    let end = address + HANDLER_SEARCH_BYTES;
    let mut buffer = [0u8; 4096];
    while address < end {
        let length = (4096 - (address % 4096)).min(end - address) as usize;
        // The stack's end: nothing more to read.
        if thread.read(address, &mut buffer[..length]).is_err() {
            break;
        }
        if buffer[..length]
            .as_chunks::<8>()
            .0
            .iter()
            .any(|word| *word == restorer.to_le_bytes())
        {
            return true;
        }
        address += length as u64;
    }
    false
}

/// System calls a thread waits in without holding an allocator, loader or stdio lock.
/// `futex` only as a condition variable's or semaphore's wait (`FUTEX_WAIT_BITSET`):
/// a lock's waiter (`FUTEX_WAIT`) may hold another lock.
#[cfg(target_arch = "x86_64")]
const WAITING_SYSCALLS: &[i64] = &[
    0,   // read
    7,   // poll
    23,  // select
    34,  // pause
    35,  // nanosleep
    43,  // accept
    45,  // recvfrom
    47,  // recvmsg
    61,  // wait4
    70,  // msgrcv
    128, // rt_sigtimedwait
    130, // rt_sigsuspend
    202, // futex (see above)
    208, // io_getevents
    230, // clock_nanosleep
    232, // epoll_wait
    247, // waitid
    270, // pselect6
    271, // ppoll
    281, // epoll_pwait
    288, // accept4
    299, // recvmmsg
    426, // io_uring_enter
    441, // epoll_pwait2
];
#[cfg(target_arch = "x86_64")]
const FUTEX: i64 = 202;

/// The same for arm64 (the generic numbers: no poll, select, pause or epoll_wait).
#[cfg(target_arch = "aarch64")]
const WAITING_SYSCALLS: &[i64] = &[
    4,   // io_getevents
    22,  // epoll_pwait
    63,  // read
    72,  // pselect6
    73,  // ppoll
    95,  // waitid
    98,  // futex (see above)
    101, // nanosleep
    115, // clock_nanosleep
    133, // rt_sigsuspend
    137, // rt_sigtimedwait
    188, // msgrcv
    202, // accept
    207, // recvfrom
    212, // recvmsg
    242, // accept4
    243, // recvmmsg
    260, // wait4
    426, // io_uring_enter
    441, // epoll_pwait2
];
#[cfg(target_arch = "aarch64")]
const FUTEX: i64 = 98;

fn is_waiting(number: i64, second_argument: u64) -> bool {
    const FUTEX_WAIT_BITSET: u64 = 9;
    WAITING_SYSCALLS.contains(&number)
        && (number != FUTEX || second_argument & 0x7f == FUTEX_WAIT_BITSET)
}

/// A thread `/proc` shows waiting: its id, the call and its first two arguments.
struct Waiting {
    tid: i32,
    number: i64,
    first: u64,
    second: u64,
}

/// The threads of `pid` that `/proc` shows waiting in one of those calls.
fn candidate_threads(pid: u32) -> Vec<Waiting> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut waiting = Vec::new();
    for task in tasks.flatten() {
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(line) = std::fs::read_to_string(task.path().join("syscall")) else {
            continue;
        };
        let mut fields = line.split_whitespace();
        let number = fields.next().and_then(|n| n.parse::<i64>().ok());
        let args: Vec<u64> = fields
            .take(2)
            .filter_map(|a| u64::from_str_radix(a.trim_start_matches("0x"), 16).ok())
            .collect();
        if let (Some(number), [first, second]) = (number, args.as_slice())
            && is_waiting(number, *second)
        {
            waiting.push(Waiting {
                tid,
                number,
                first: *first,
                second: *second,
            });
        }
    }
    waiting
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_futex_wait_counts_only_as_a_condition_variables() {
        assert!(is_waiting(WAITING_SYSCALLS[1], 0), "a waiting call");
        assert!(is_waiting(FUTEX, 9 | 128), "FUTEX_WAIT_BITSET_PRIVATE");
        assert!(
            !is_waiting(FUTEX, 128),
            "FUTEX_WAIT_PRIVATE: a lock's waiter"
        );
        assert!(
            !is_waiting(222, 0),
            "mmap (arm64), or a call never waited in"
        );
    }
}
