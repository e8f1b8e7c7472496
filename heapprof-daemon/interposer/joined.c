/*
 * A joined process (--pid): what the join holds while it lasts (the slots redirected,
 * the descriptors heapprofd handed over), the look now and then for heapprofd's death
 * and for objects loaded since, and leaving. join.c joins; a following exec's image
 * joins at start-up (lifecycle.c).
 */
#include "joined.h"

#include "got.h"
#include "interposer.h"
#include "report.h"
#include "state.h"
#include "thread.h"

/* The slots redirected: the C functions, and C++'s operators when they do not
 * allocate with malloc (libstdc++'s do: malloc's wrapper sees their calls). */
struct got_target redirected[REDIRECTED_MOST];
unsigned redirected_count;

/* heapprofd itself, while the library is joined: its exit (a SIGKILL, a crash) makes
 * the descriptor readable. */
int daemon_pidfd = -1;

/* While joined, what an exec hands the new image: the library's own file and the
 * answers' map (both received from heapprofd), and the process that joined, whose
 * exec alone is followed (a forked child's is not: heapprofd traces the process). */
int library_fd = -1, replies_fd = -1;
int joined_pid;
/* Preloaded into the image a following exec started: the allocation functions are
 * bound to the wrappers already, only the exec functions are redirected. */
int followed;

/* What a handed descriptor was when it was handed over: its inode and device (statx),
 * if the kernel said. */
struct identity {
    uint64_t inode;
    uint64_t device;
    int known;
};
static struct identity pidfd_identity, library_identity, replies_identity;

#if defined(__x86_64__)
#define SYS_STATX 332
#elif defined(__aarch64__)
#define SYS_STATX 291
#endif
#define AT_EMPTY_PATH_ 0x1000
#define STATX_INO_ 0x100
#define EBADF_ 9

/* statx of descriptor `fd` into `out`: 0, or the errno (the caller's errno is kept). */
static int identify(int fd, struct identity *out)
{
    uint64_t buffer[32]; /* struct statx, 256 bytes */
    int saved = *__errno_location();
    long result = syscall(SYS_STATX, fd, "", AT_EMPTY_PATH_, STATX_INO_, buffer);
    int error = result == 0 ? 0 : *__errno_location();
    *__errno_location() = saved;
    if (error)
        return error;
    out->inode = buffer[4];   /* stx_ino, at byte 32 */
    out->device = buffer[17]; /* stx_dev_major and stx_dev_minor, at byte 136 */
    out->known = 1;
    return 0;
}

/* Whether `fd` is still the descriptor noted as `then`. One whose identity the kernel
 * would not say (no statx before 4.11, a seccomp filter) is trusted, as it was. */
static int still_handed(int fd, const struct identity *then)
{
    if (fd < 0)
        return 0;
    if (!then->known)
        return 1;
    struct identity now = { 0, 0, 0 };
    int error = identify(fd, &now);
    if (error)
        return error != EBADF_;
    return now.inode == then->inode && now.device == then->device;
}

void remember_handed(void)
{
    pidfd_identity = library_identity = replies_identity = (struct identity){ 0, 0, 0 };
    if (daemon_pidfd >= 0)
        identify(daemon_pidfd, &pidfd_identity);
    if (library_fd >= 0)
        identify(library_fd, &library_identity);
    if (replies_fd >= 0)
        identify(replies_fd, &replies_identity);
}

int daemon_gone(void)
{
    if (daemon_pidfd < 0)
        return 0;
    if (!still_handed(daemon_pidfd, &pidfd_identity)) {
        daemon_pidfd = -1; /* the program's now */
        return 1;
    }
    struct {
        int fd;
        short events;
        short revents;
    } watch = { daemon_pidfd, 1 /* POLLIN */, 0 };
    return poll(&watch, 1, 0) > 0;
}

/* The descriptors a join or a following exec handed over, closed when leaving: those
 * still the ones handed (a program that dup2'd a file of its own onto one keeps it). */
void close_handed(void)
{
    if (still_handed(daemon_pidfd, &pidfd_identity))
        close(daemon_pidfd);
    if (still_handed(library_fd, &library_identity))
        close(library_fd);
    if (still_handed(replies_fd, &replies_identity))
        close(replies_fd);
    daemon_pidfd = library_fd = replies_fd = -1;
}

/* Whether a forked child stays joined (heapprofd traces the process's children too);
 * otherwise the child's wrappers pass every call on. */
int children_joined;

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
uint64_t loads_seen;
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

uint64_t loader_adds(void)
{
    /* The last count read: what a check sees while another thread walks (no change,
     * so it looks again at its next check). */
    static uint64_t last;
    uint64_t adds = 0;
    extern int dl_iterate_phdr(int (*callback)(void *, size_t, void *), void *data);
    if (!got_walk_try())
        return __atomic_load_n(&last, __ATOMIC_RELAXED);
    dl_iterate_phdr(read_adds, &adds);
    got_walk_end();
    __atomic_store_n(&last, adds, __ATOMIC_RELAXED);
    return adds;
}

/* Puts the slots back and passes every call on from now on: heapprofd detaches, or
 * it has died. The answers' map is replaced by untouched memory in place (a wrapper
 * of another thread may still read it), which releases the map; the library and its
 * memory stay for a later join. Returns the slots put back. */
long heapprofd_leave_now(void)
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

/* Code pages of this library that heapprofd fills, in its process's copy only, with
 * the return stub of its calls into the process (heapprof-daemon's
 * src/inject/regs.rs): a call that heapprofd's death leaves running resumes the
 * thread where heapprofd held it. Int3 (x86-64) or udf (arm64, whose stub also holds
 * a signal frame: two pages) until then. */
#if defined(__x86_64__)
__asm__(".text\n"
        ".p2align 12\n"
        ".globl heapprofd_resume_area\n"
        ".type heapprofd_resume_area, @function\n"
        "heapprofd_resume_area:\n"
        "    .fill 4096, 1, 0xcc\n"
        ".size heapprofd_resume_area, 4096\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".p2align 12\n"
        ".globl heapprofd_resume_area\n"
        ".type heapprofd_resume_area, %function\n"
        "heapprofd_resume_area:\n"
        "    .fill 8192, 1, 0\n"
        ".size heapprofd_resume_area, 8192\n");
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
    if (daemon_gone()) {
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
