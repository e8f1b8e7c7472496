/*
 * Joining a running process and leaving it.
 *
 * `heapprofd --pid` loads this library into a running process (ptrace, dlopen) and
 * calls heapprofd_join: the real functions are the ones the process's global scope
 * binds, and the slots its objects call them through are pointed at the wrappers
 * (got.c). heapprofd_leave puts the slots back; the library then passes every call
 * that still reaches it straight on, and a later heapprofd joins the same copy again.
 */
#include "join.h"

#include "exec_follow.h"
#include "fork.h"
#include "got.h"
#include "interposer.h"
#include "lifecycle.h"
#include "preload_abi.h"
#include "report.h"
#include "thread.h"
#include "wrappers.h"

/* The slots redirected: the C functions, and C++'s operators when they do not
 * allocate with malloc (libstdc++'s do: malloc's wrapper sees their calls). */
static struct got_target redirected[48];
static unsigned redirected_count;

/* The exec functions, so that an exec takes the library along (exec_follow.c). */
static void choose_exec_targets(void)
{
    unsigned room = sizeof redirected / sizeof redirected[0] - redirected_count;
    redirected_count += hp_exec_targets(redirected + redirected_count, room);
}

static void choose_targets(void)
{
    redirected_count = alloc_targets(redirected, sizeof redirected / sizeof redirected[0]);
    choose_exec_targets();
}

static void *lookup_default(const char *name) { return dlsym(RTLD_DEFAULT, name); }

/* heapprofd itself, while the library is joined: its exit (a SIGKILL, a crash) makes
 * the descriptor readable. */
static int daemon_pidfd = -1;

/* While joined, what an exec hands the new image: the library's own file and the
 * answers' map (both received from heapprofd), and the process that joined, whose
 * exec alone is followed (a forked child's is not: heapprofd traces the process). */
static int library_fd = -1, replies_fd = -1;
static int joined_pid;
/* Preloaded into the image a following exec started: the allocation functions are
 * bound to the wrappers already, only the exec functions are redirected. */
static int followed;

/* The descriptors a join or a following exec handed over, closed when leaving. */
static void close_handed(void)
{
    if (daemon_pidfd >= 0)
        close(daemon_pidfd);
    if (library_fd >= 0)
        close(library_fd);
    if (replies_fd >= 0)
        close(replies_fd);
    daemon_pidfd = library_fd = replies_fd = -1;
}

/* Whether a forked child stays joined (heapprofd traces the process's children too);
 * otherwise the child's wrappers pass every call on. */
static int children_joined;

/* A forked child of a joined process that heapprofd does not trace: its calls pass on
 * (its slots are left as they are: the loader's lock, which a rewrite takes, may be
 * held by a thread that did not come along). */
void leave_in_child(void)
{
    if (children_joined)
        return;
    __atomic_store_n(&state, INERT, __ATOMIC_RELEASE);
    close_handed();
}

int hp_follow_state(struct hp_follow *follow)
{
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != ACTIVE || library_fd < 0 ||
        replies_fd < 0 || daemon_pidfd < 0 || getpid() != joined_pid)
        return 0;
    *follow = (struct hp_follow){ library_fd, replies_fd, daemon_pidfd, sample_rate,
                                  children_joined };
    return 1;
}



/* Objects the loader has added, when the slots were last rewritten, and how many
 * checks will look at every object's slots again. */
static uint64_t loads_seen;
static uint32_t rescans_left;
#define RESCANS 4

struct phdr_info_adds {
    uint64_t addr;
    const char *name;
    const void *phdr;
    uint16_t phnum;
    unsigned long long adds;
    unsigned long long subs;
};

static int read_adds(void *info, size_t size, void *data)
{
    const struct phdr_info_adds *i = info;
    *(uint64_t *)data = size >= sizeof *i ? i->adds : 0;
    return 1;
}

static uint64_t loader_adds(void)
{
    uint64_t adds = 0;
    extern int dl_iterate_phdr(int (*callback)(void *, size_t, void *), void *data);
    dl_iterate_phdr(read_adds, &adds);
    return adds;
}

/* The image a following exec started: joined from its first call, like a launched
 * program, with what the exec handed over; its own execs are followed in turn. */
void start_followed(const struct hp_follow *follow)
{
    followed = 1;
    library_fd = follow->library;
    replies_fd = follow->replies;
    daemon_pidfd = follow->pidfd;
    children_joined = follow->children;
    joined_pid = getpid();
    sample_rate = follow->rate;
    map_replies_fd(replies_fd);
    prepare_sampling();
    register_fork_handlers();
    redirected_count = 0;
    choose_exec_targets();
    loads_seen = loader_adds();
    got_rewrite(redirected, redirected_count, __ehdr_start, 0, 1);
    hello();
    __atomic_store_n(&state, ACTIVE, __ATOMIC_RELEASE);
}

/* Puts the slots back and passes every call on from now on: heapprofd detaches, or
 * it has died. The answers' map is replaced by untouched memory in place (a wrapper
 * of another thread may still read it), which releases the map; the library and its
 * memory stay for a later join. Returns the slots put back. */
static long heapprofd_leave_now(void)
{
    int expected = ACTIVE;
    if (!__atomic_compare_exchange_n(&state, &expected, INERT, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return 0;
    struct got_result result = got_rewrite(redirected, redirected_count, __ehdr_start, 1, 1);
    struct thread_state *t = pthread_getspecific(thread_key);
    if (t && t != &no_state && t->session == session)
        flush(t);
    if (replies) {
        void *blank = mmap(replies, REPLIES_BYTES, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        (void)blank; /* on failure the map stays mapped, still harmless */
    }
    close_handed();
    return (long)result.rewritten;
}

/* A page of this library's code that heapprofd fills, in its process's copy only,
 * with the return stub of its calls into the process (heapprof-daemon's
 * src/inject/regs.rs): a call that heapprofd's death leaves running resumes the
 * thread where heapprofd held it. Int3 until then. */
#if defined(__x86_64__)
__asm__(".text\n"
        ".p2align 12\n"
        ".globl heapprofd_resume_area\n"
        ".type heapprofd_resume_area, @function\n"
        "heapprofd_resume_area:\n"
        "    .fill 4096, 1, 0xcc\n"
        ".size heapprofd_resume_area, 4096\n");
#endif

/* Called by heapprofd through ptrace when it detaches. */
EXPORT long heapprofd_leave(void) { return heapprofd_leave_now(); }

/* Now and then (every CHECK_EVERY allocations of a thread): leaves if heapprofd has
 * died without detaching, and redirects the slots of objects loaded since the last
 * look (dlopen). */
__attribute__((noinline)) void injected_check(void)
{
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != ACTIVE)
        return;
    struct {
        int fd;
        short events;
        short revents;
    } watch = { daemon_pidfd, 1 /* POLLIN */, 0 };
    if (watch.fd >= 0 && poll(&watch, 1, 0) > 0) {
        heapprofd_leave_now();
        return;
    }
    /* The loader counts an object when it maps it, before it relocates it: its slots
     * are looked at again in the next few checks, once they hold their functions. */
    uint64_t adds = loader_adds();
    if (adds != __atomic_load_n(&loads_seen, __ATOMIC_RELAXED)) {
        __atomic_store_n(&loads_seen, adds, __ATOMIC_RELAXED);
        __atomic_store_n(&rescans_left, RESCANS, __ATOMIC_RELAXED);
    } else if (__atomic_load_n(&rescans_left, __ATOMIC_RELAXED) == 0) {
        return;
    } else {
        __atomic_sub_fetch(&rescans_left, 1, __ATOMIC_RELAXED);
    }
    got_rewrite(redirected, redirected_count, __ehdr_start, 0, 0);
    /* heapprofd left during the pass: what it redirected goes back. */
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) != ACTIVE)
        got_rewrite(redirected, redirected_count, __ehdr_start, 1, 1);
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

/* heapprofd_join's flags: forked children stay joined (they are traced too). */
#define JOIN_CHILDREN 1u

/* Why heapprofd_join refused, as its negative results. */
enum join_error {
    JOIN_NOT_INJECTED = -1,   /* a launch-mode copy */
    JOIN_ALREADY = -2,        /* joined now */
    JOIN_NO_DESCRIPTORS = -3, /* nothing received */
    JOIN_NO_ALLOCATOR = -4,   /* the process binds no malloc/free */
    JOIN_NO_SLOTS = -5,       /* no slot could be redirected */
};

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
    map_replies_fd(replies_received);
    replies_fd = replies_received;
    daemon_pidfd = pidfd;
    library_fd = library;
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
