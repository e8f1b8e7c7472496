/*
 * Joining a running process: heapprofd_join (what a join holds, and leaving, are
 * joined.c's).
 *
 * `heapprofd --pid` loads this library into a running process (ptrace, dlopen) and
 * calls heapprofd_join: the real functions are the ones the process's global scope
 * binds, and the slots its objects call them through are pointed at the wrappers
 * (got.c). heapprofd_leave puts the slots back; the library then passes every call
 * that still reaches it straight on, and a later heapprofd joins the same copy again.
 */
#include "fork.h"
#include "got.h"
#include "interposer.h"
#include "join.h"
#include "joined.h"
#include "lifecycle.h"
#include "preload_abi.h"
#include "report.h"
#include "state.h"
#include "thread.h"
#include "wrappers.h"

static void choose_targets(void)
{
    redirected_count = alloc_targets(redirected, REDIRECTED_MOST);
#ifndef HP_SYSTEM_PRELOAD
    /* The system-wide copy needs no following: every new image loads it again. */
    choose_exec_targets();
#endif
}

static void *lookup_default(const char *name) { return dlsym(RTLD_DEFAULT, name); }

extern int fcntl(int fd, int command, ...);
#define F_DUPFD_CLOEXEC_ 1030

/* Moves a descriptor heapprofd handed over (received at the lowest free number) to
 * HP_FIRST_HIGH_DESCRIPTOR or above. A program that put a file of its own at its old
 * number would lose it: the library would poll that file as heapprofd's pidfd (a
 * regular file reads as "heapprofd has exited") and close it when leaving (`configure`
 * lost its `exec 6>&1` so). Where no higher number can be had, it stays. */
static int move_up(int fd)
{
    if (fd < 0 || fd >= HP_FIRST_HIGH_DESCRIPTOR)
        return fd;
    int saved = *__errno_location();
    int high = fcntl(fd, F_DUPFD_CLOEXEC_, HP_FIRST_HIGH_DESCRIPTOR);
    if (high >= 0) {
        close(fd);
        fd = high;
    }
    *__errno_location() = saved;
    return fd;
}

/* Receives the descriptors heapprofd sends over `socket`: the program's answers (a BPF
 * map) and heapprofd's pidfd. */
static int receive_descriptors(int socket, int *replies, int *pidfd, int *library)
{
    struct iovec_ {
        void *base;
        size_t length;
    };
    struct message_ {
        void *name;
        uint32_t name_length;
        uint32_t pad0;
        struct iovec_ *iov;
        size_t iov_length;
        void *control;
        size_t control_length;
        int flags;
        int pad1;
    };
    union {
        struct {
            uint64_t length;
            int level;
            int type;
            int fds[3];
        } header;
        uint64_t align[4];
    } control = { .align = { 0 } };
    char byte;
    struct iovec_ io = { &byte, 1 };
    struct message_ message = { .iov = &io, .iov_length = 1, .control = &control,
                                .control_length = sizeof control };
    const int cmsg_cloexec = 0x40000000, sol_socket = 1, scm_rights = 1;
    long got = recvmsg(socket, &message, cmsg_cloexec);
    if (got < 1 || control.header.level != sol_socket || control.header.type != scm_rights ||
        control.header.length < 16 + 2 * sizeof(int))
        return -1;
    *replies = control.header.fds[0];
    *pidfd = control.header.fds[1];
    /* The library's own file, which an exec takes along (absent: execs are not followed). */
    *library = control.header.length >= 16 + 3 * sizeof(int) ? control.header.fds[2] : -1;
    return 0;
}

/*
 * Joins heapprofd: `socket` carries the answers' map and heapprofd's pidfd, and
 * `rate` is the sample rate (0: every allocation). Called by heapprofd through ptrace
 * on a thread that holds no allocator or loader lock. Returns the slots redirected,
 * or a join_error.
 */
EXPORT long heapprofd_join(int socket, uint64_t rate, uint64_t flags)
{
    if (!injected())
        return JOIN_NOT_INJECTED;
    int now = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (now != UNINITIALIZED && now != INERT)
        return JOIN_ALREADY;
    int replies_received, pidfd, library;
    if (receive_descriptors(socket, &replies_received, &pidfd, &library) != 0)
        return JOIN_NO_DESCRIPTORS;
    return hp_join_with(replies_received, pidfd, library, rate, flags);
}

long hp_join_with(int replies_received, int pidfd, int library, uint64_t rate, uint64_t flags)
{
    int now = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (now != UNINITIALIZED && now != INERT) {
        close(replies_received);
        close(pidfd);
        if (library >= 0)
            close(library);
        return JOIN_ALREADY;
    }
    if (now == UNINITIALIZED) {
        find_real_functions(lookup_default);
        if (!real.malloc || !real.free || !real.calloc || !real.realloc ||
            pthread_key_create(&thread_key, thread_ends) != 0) {
            close(replies_received);
            close(pidfd);
            if (library >= 0)
                close(library);
            return JOIN_NO_ALLOCATOR;
        }
        learn_allocator();
    }
    replies_received = move_up(replies_received);
    pidfd = move_up(pidfd);
    library = move_up(library);
    map_replies_fd(replies_received);
    replies_fd = replies_received;
    daemon_pidfd = pidfd;
    library_fd = library;
    remember_handed();
    joined_pid = getpid();
    children_joined = (flags & JOIN_CHILDREN) != 0;
    sample_rate = rate;
    prepare_sampling();
    register_fork_handlers();
    __atomic_add_fetch(&session, 1, __ATOMIC_RELEASE);
    /* An image a following exec started binds the allocation functions here already. */
    if (followed) {
        redirected_count = 0;
        choose_exec_targets();
    } else {
        choose_targets();
    }
    loads_seen = loader_adds();
    __atomic_store_n(&state, ACTIVE, __ATOMIC_RELEASE);
    hello();
    struct got_result result = got_rewrite(redirected, redirected_count, __ehdr_start, 0, 1);
    if (followed)
        return (long)result.rewritten + 1;
    if (result.rewritten == 0) {
        heapprofd_leave_now();
        return JOIN_NO_SLOTS;
    }
    return (long)result.rewritten;
}

