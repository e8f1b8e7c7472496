/*
 * The library's start in a process: the real functions and what they tell of the
 * allocator, the program's answers, the first hello, from the constructor or the
 * first wrapped call (a following exec's image joins here, with what the exec handed
 * over); and the exiting thread's last report.
 */
#include "lifecycle.h"

#include "exec_follow.h"
#include "fork.h"
#include "got.h"
#include "joined.h"
#include "probe_site.h"
#include "report.h"
#include "state.h"
#include "thread.h"

void *next(const char *name) { return dlsym(RTLD_NEXT, name); }

/* The executable segments of the object loaded at `base`, from its ELF headers in
 * memory (a shared object maps them with its first segment). */
static void find_allocator_text(const unsigned char *base)
{
    if (!base || base[0] != 0x7f || base[1] != 'E' || base[2] != 'L' || base[3] != 'F' ||
        base[4] != 2 /* ELFCLASS64 */)
        return;
    uint64_t phoff = *(const uint64_t *)(base + 0x20);
    uint16_t phentsize = *(const uint16_t *)(base + 0x36);
    uint16_t phnum = *(const uint16_t *)(base + 0x38);
    if (phentsize < 56 || phnum == 0 || phnum > 64 || phoff > 4096)
        return;
    uint64_t lowest = UINT64_MAX, start = UINT64_MAX, end = 0;
    for (uint16_t i = 0; i < phnum; i++) {
        const unsigned char *ph = base + phoff + (uint64_t)i * phentsize;
        uint32_t type = *(const uint32_t *)ph;
        uint32_t flags = *(const uint32_t *)(ph + 4);
        uint64_t vaddr = *(const uint64_t *)(ph + 16);
        uint64_t memsz = *(const uint64_t *)(ph + 40);
        if (type != 1 /* PT_LOAD */)
            continue;
        if (vaddr < lowest)
            lowest = vaddr;
        if (flags & 1 /* PF_X */) {
            if (vaddr < start)
                start = vaddr;
            if (vaddr + memsz > end)
                end = vaddr + memsz;
        }
    }
    if (start >= end || lowest == UINT64_MAX)
        return;
    uint64_t bias = (uint64_t)(uintptr_t)base - (lowest & ~(uint64_t)4095);
    allocator_text_start = bias + start;
    allocator_text_end = bias + end;
}


/* Whether the C++ operators found next are libstdc++'s (or libc++'s), which allocate
 * with malloc: those pass through and malloc reports, as without this library. */
static int cxx_allocates_with_malloc(void)
{
    dl_info_t info;
    if (!real.cxx_new[0] || !dladdr((void *)real.cxx_new[0], &info) || !info.dli_fname)
        return 1;
    const char *name = info.dli_fname;
    for (const char *c = name; *c; c++)
        if (*c == '/')
            name = c + 1;
    return (name[0] == 'l' && name[1] == 'i' && name[2] == 'b' && name[3] == 's' &&
            name[4] == 't' && name[5] == 'd' && name[6] == 'c' && name[7] == '+') ||
           (name[0] == 'l' && name[1] == 'i' && name[2] == 'b' && name[3] == 'c' &&
            name[4] == '+' && name[5] == '+');
}

static uint64_t parse_u64(const char *s);

/* Maps the program's answers from `descriptor`, a BPF map; where an earlier join's
 * answers were (an injected library joins again), in their place. */
void map_replies_fd(int descriptor)
{
    void *mapped = mmap(replies, REPLIES_BYTES, PROT_READ | PROT_WRITE,
                        MAP_SHARED | (replies ? MAP_FIXED : 0), descriptor, 0);
    replies = mapped == MAP_FAILED ? NULL : mapped;
}

/* Maps the program's answers, if heapprofd handed the map over: the descriptor named
 * by HEAPPROFD_REPLIES_FD, if it is a BPF map (the variable may outlive it: a program
 * may close descriptors it does not know, then open others). */
static void map_replies(void)
{
    uint64_t fd = parse_u64(getenv(HP_REPLIES_FD_ENV));
    if (fd == 0 || fd > 999999)
        return;
    int descriptor = (int)fd;
    char path[32] = "/proc/self/fd/";
    char digits[8];
    int n = 0;
    do
        digits[n++] = (char)('0' + fd % 10);
    while ((fd /= 10) != 0);
    int at = 14;
    while (n > 0)
        path[at++] = digits[--n];
    path[at] = 0;
    static const char expected[] = "anon_inode:bpf-map";
    char target[sizeof expected + 1];
    long length = readlink(path, target, sizeof target);
    if (length != (long)sizeof expected - 1)
        return;
    for (long i = 0; i < length; i++)
        if (target[i] != expected[i])
            return;
    map_replies_fd(descriptor);
}

static uint64_t parse_u64(const char *s)
{
    uint64_t value = 0;
    for (; s && *s >= '0' && *s <= '9'; s++)
        value = value * 10 + (uint64_t)(*s - '0');
    return value;
}

/* Looks up the real functions: the ones after this library in the binding order
 * (preloaded), or the ones the process's global scope binds (injected, loaded alone). */
void find_real_functions(void *(*lookup)(const char *))
{
    real.malloc = lookup("malloc");
    real.calloc = lookup("calloc");
    real.realloc = lookup("realloc");
    real.reallocarray = lookup("reallocarray");
    real.posix_memalign = lookup("posix_memalign");
    real.aligned_alloc = lookup("aligned_alloc");
    real.memalign = lookup("memalign");
    real.valloc = lookup("valloc");
    real.pvalloc = lookup("pvalloc");
    real.free = lookup("free");
    for (unsigned i = 0; i < 8; i++)
        real.cxx_new[i] = lookup(hp_function_names[HP_FN_FIRST_NEW + i]);
    for (unsigned i = 0; i < 12; i++)
        real.cxx_delete[i] = lookup(hp_function_names[HP_FN_FIRST_DELETE + i]);
}

/* What the real functions tell: whether C++'s operators allocate with malloc, where
 * the allocator's code is, and the page size. */
void learn_allocator(void)
{
    cxx_through_malloc = cxx_allocates_with_malloc();
    dl_info_t allocator;
    if (dladdr((void *)real.malloc, &allocator))
        find_allocator_text(allocator.dli_fbase);
    dl_info_t cxx;
    if (real.cxx_new[0] && dladdr((void *)real.cxx_new[0], &cxx))
        cxx_base = cxx.dli_fbase;
    long page = sysconf(SC_PAGESIZE);
    if (page > 0)
        page_size = (uint64_t)page;
}

/* The exec functions, so that an exec takes the library along (exec_follow.c). */
void choose_exec_targets(void)
{
    unsigned room = REDIRECTED_MOST - redirected_count;
    redirected_count += hp_exec_targets(redirected + redirected_count, room);
}

/* The image a following exec started: joined from its first call, like a launched
 * program, with what the exec handed over; its own execs are followed in turn. */
static void start_followed(const struct hp_follow *follow)
{
    followed = 1;
    library_fd = follow->library;
    replies_fd = follow->replies;
    daemon_pidfd = follow->pidfd;
    remember_handed();
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

void initialize(void)
{
    struct hp_follow follow;
    int following = -1;
    if (injected()) {
        /* Preloaded into the new image of a joined process that exec'd (exec_follow.c),
         * or loaded into a running process, where heapprofd_join starts it. */
        following = hp_followed_start(&follow);
        if (following < 0)
            return;
    }
    int expected = UNINITIALIZED;
    if (!__atomic_compare_exchange_n(&state, &expected, INITIALIZING, 0, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE))
        return; /* another thread is at it: the arena serves meanwhile */
    find_real_functions(next);
    /* Only the program comes before this library in the binding order. If it defines
     * malloc itself, its calls (and the libraries') bind there and heapprofd's probes
     * on the program count them; this library then sees the functions it does not
     * define. If it only takes malloc's address (a non-PIE program's canonical PLT
     * entry, as python3's), that entry leads here. Either way it stays active. */
    if (!real.malloc || !real.free || !real.calloc || !real.realloc ||
        pthread_key_create(&thread_key, thread_ends) != 0) {
        __atomic_store_n(&state, INERT, __ATOMIC_RELEASE);
        return;
    }
    learn_allocator();
    if (following == 1) {
        start_followed(&follow);
        return;
    }
    if (following == 0) {
        /* A following exec whose variables could not be read: calls pass on. */
        __atomic_store_n(&state, INERT, __ATOMIC_RELEASE);
        return;
    }
    sample_rate = parse_u64(getenv(HP_SAMPLE_RATE_ENV));
    map_replies();
    prepare_sampling();
    register_fork_handlers();
    hello();
    __atomic_store_n(&state, ACTIVE, __ATOMIC_RELEASE);
}

/* The system-wide build starts in system.c instead: it joins or stays inert. */
#ifndef HP_SYSTEM_PRELOAD
__attribute__((constructor)) static void on_load(void)
{
    if (state == UNINITIALIZED)
        initialize();
}
#endif

/* The thread calling exit() reports its last records and, from then on, each record
 * at once, its queue unknown to the program in between: kernels that run the exit
 * tracepoint after the address space is gone (6.1) cannot read it at the thread's
 * exit. (Other threads' queues are read by heapprofd when they exit.) */
__attribute__((destructor)) static void on_unload(void)
{
    if (state != ACTIVE)
        return;
    struct thread_state *t = pthread_getspecific(thread_key);
    if (!t || t == &no_state)
        return;
    t->closing = 1;
    if (!t->registered) {
        flush(t);
        return;
    }
    busy_begin(t);
    probe(0, 0, 0, 0, 0, queue_address(t), meta(t, 0, HP_KIND_FLUSH) | HP_META_UNREGISTER_QUEUE);
    reported(t);
    busy_end(t);
}
