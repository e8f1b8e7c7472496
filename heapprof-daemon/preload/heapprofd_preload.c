/*
 * heapprofd's preload library: launch mode's interposer.
 *
 * heapprofd puts this object in the LD_PRELOAD of the commands it launches. It wraps
 * the C and C++ allocation functions, calls the real ones (whatever object the
 * dynamic linker finds next: glibc, musl, jemalloc, tcmalloc, mimalloc) and reports
 * each allocation through one call of the probe site, where heapprofd's uprobe reads
 * it (see heapprof-common's `preload` module for the interface; preload_abi.h is
 * generated from it). Frees are queued per thread and reported with the next call.
 *
 * The program answers each allocation report, in the thread's slot of a BPF map that
 * heapprofd hands the process (HEAPPROFD_REPLIES_FD), with the places of the stack
 * words its walk read. While an allocation's caller has the same registers and those words are
 * unchanged, the walk would find the same frames: such an allocation is queued with
 * the stack's hash, like a free, and costs no probe (the "known stacks").
 *
 * It links against nothing (no DT_NEEDED): the few C library functions it uses bind
 * to whatever C library the process has, so one build loads into glibc and musl
 * programs alike. It allocates nothing itself after start-up, and until the real
 * functions are known (dlsym may allocate) it serves from a small static arena.
 *
 * Sampling (HEAPPROFD_SAMPLE_RATE) is decided here, so that unsampled calls cost no
 * probe at all; frees are then reported only for the sampled blocks, which a small
 * lock-free set remembers.
 */
#include <stddef.h>
#include <stdint.h>

#include "exec_follow.h"
#include "got.h"
#include "preload_abi.h"

#define EXPORT __attribute__((visibility("default")))
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

/* The C library functions used, bound at load time to the process's C library. */
typedef struct {
    const char *dli_fname;
    void *dli_fbase;
    const char *dli_sname;
    void *dli_saddr;
} dl_info_t;
extern void *dlsym(void *handle, const char *symbol);
extern int dladdr(const void *address, dl_info_t *info);
extern char *getenv(const char *name);
extern long sysconf(int name);
/* Fork handlers: glibc's own registration (its pthread_atfork is a static stub in
 * libc_nonshared.a, exported by libc.so.6 only as an x86-64 compatibility symbol),
 * or musl's pthread_atfork. Weak: the one the C library lacks is NULL. */
extern int __register_atfork(void (*prepare)(void), void (*parent)(void), void (*child)(void),
                             void *dso_handle) __attribute__((weak));
extern int pthread_atfork(void (*prepare)(void), void (*parent)(void), void (*child)(void))
    __attribute__((weak));
extern void *mmap(void *address, size_t length, int prot, int flags, int fd, long offset);
extern int pthread_key_create(unsigned *key, void (*destructor)(void *));
extern void *pthread_getspecific(unsigned key);
extern int pthread_setspecific(unsigned key, const void *value);
extern long readlink(const char *path, char *buffer, size_t size);
extern long recvmsg(int fd, void *message, int flags);
extern int poll(void *fds, unsigned long count, int timeout);
extern int close(int fd);
extern int mprotect(void *address, size_t length, int prot);
extern int getpid(void);
#define RTLD_NEXT ((void *)-1L)
#define RTLD_DEFAULT ((void *)0)
#define SC_PAGESIZE 30 /* the same on glibc and musl */
#define PROT_READ 1
#define PROT_WRITE 2
#define MAP_SHARED 1
#define MAP_PRIVATE 2
#define MAP_FIXED 0x10
#define MAP_ANONYMOUS 0x20
#define MAP_FAILED ((void *)-1)

/* ---- the probe site ---------------------------------------------------------- */

/*
 * A 5-byte NOP and a return: the kernel optimizes a uprobe there into a call. The
 * wrappers reach it through a hidden alias (no PLT); the exported name is how
 * heapprofd finds it in the file.
 */
#if defined(__x86_64__)
__asm__(".text\n"
        ".globl " HP_PROBE_SITE_SYMBOL "\n"
        ".type " HP_PROBE_SITE_SYMBOL ", @function\n"
        ".globl hp_probe_site_local\n"
        ".hidden hp_probe_site_local\n"
        ".p2align 4\n" HP_PROBE_SITE_SYMBOL ":\n"
        "hp_probe_site_local:\n"
        "    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n"
        "    ret\n"
        ".size " HP_PROBE_SITE_SYMBOL ", . - " HP_PROBE_SITE_SYMBOL "\n");

/* The call clobbers nothing: the site only returns (the red zone is off, see the
 * build flags, so the pushed return address overwrites nothing). */
static inline __attribute__((always_inline)) void
probe(uint64_t block, uint64_t size, uint64_t ra, uint64_t cfa, uint64_t fp,
      uint64_t queue, uint64_t meta)
{
    register uint64_t r8 __asm__("r8") = fp;
    register uint64_t r9 __asm__("r9") = queue;
    __asm__ volatile("call hp_probe_site_local"
                     :
                     : "D"(block), "S"(size), "d"(ra), "c"(cfa), "r"(r8), "r"(r9),
                       "a"(meta)
                     : "memory");
}
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl " HP_PROBE_SITE_SYMBOL "\n"
        ".type " HP_PROBE_SITE_SYMBOL ", %function\n"
        ".globl hp_probe_site_local\n"
        ".hidden hp_probe_site_local\n"
        ".p2align 4\n" HP_PROBE_SITE_SYMBOL ":\n"
        "hp_probe_site_local:\n"
        "    nop\n"
        "    ret\n"
        ".size " HP_PROBE_SITE_SYMBOL ", . - " HP_PROBE_SITE_SYMBOL "\n");

static inline __attribute__((always_inline)) void
probe(uint64_t block, uint64_t size, uint64_t ra, uint64_t cfa, uint64_t fp,
      uint64_t queue, uint64_t meta)
{
    register uint64_t x0 __asm__("x0") = block;
    register uint64_t x1 __asm__("x1") = size;
    register uint64_t x2 __asm__("x2") = ra;
    register uint64_t x3 __asm__("x3") = cfa;
    register uint64_t x4 __asm__("x4") = fp;
    register uint64_t x5 __asm__("x5") = queue;
    register uint64_t x6 __asm__("x6") = meta;
    __asm__ volatile("bl hp_probe_site_local"
                     :
                     : "r"(x0), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5), "r"(x6)
                     : "x30", "memory");
}
#else
#error "heapprofd's preload library supports x86-64 and arm64"
#endif

/* The caller's registers at the wrapper's return, taken in the wrapper itself (built
 * with frame pointers: the wrapper's frame record holds the caller's frame pointer). */
#define CALLER_RA() ((uint64_t)__builtin_extract_return_addr(__builtin_return_address(0)))
#define CALLER_SP() ((uint64_t)__builtin_dwarf_cfa())
#define CALLER_FP() (*(uint64_t *)__builtin_frame_address(0))

/* ---- per-thread state --------------------------------------------------------- */

/* A stack the program walked for this thread: its caller's registers and the stack
 * words the walk read (offsets from `cfa`, values as they were). */
struct known_stack {
    uint64_t ra; /* 0: empty */
    uint64_t cfa;
    uint64_t fp;
    uint64_t hash;
    uint32_t reads;
    uint32_t uses_fp;
    int32_t offsets[HP_REPLY_READS];
    uint64_t values[HP_REPLY_READS];
};

/* Known stacks per thread, any in any place: their return addresses are kept apart,
 * where one scan finds the candidates (a hash into sets made a few of a program's
 * hot sites evict each other on every call). Replaced in turn. */
#define KNOWN_STACKS 32

/* A thread's reply_slot when the map had no slot left for it. */
#define NO_SLOT 0xffffffffu

struct thread_state {
    struct hp_report_queue queue; /* read by the BPF program */
    uint32_t depth;               /* inside a real allocator call: nested calls pass */
    uint32_t registered;          /* the queue's address was reported */
    uint32_t cxx_depth;           /* inside a replacement allocator's C++ operator */
    uint32_t reply_slot;          /* its slot of `replies`; 0 until taken */
    uint32_t queue_busy;          /* the queue is being changed (see busy_begin) */
    uint32_t closing;             /* exit() has begun: records are reported at once */
    uint64_t until_sample;           /* bytes left before the next sampled allocation */
    uint64_t random;                 /* xorshift state */
    uint32_t known_victim;                /* the place replaced next */
    uint64_t known_ra[KNOWN_STACKS];      /* known[i].ra, or 0 */
    struct known_stack known[KNOWN_STACKS];
    struct thread_state *next_spare;      /* in `spare_states` */
    uint32_t session;                     /* the join it belongs to (see `session`) */
    uint32_t until_check;                 /* calls left before the next injected_check */
};

/*
 * Each thread's state is found through a pthread key, not thread-local storage: a TLS
 * block would make this library one more TLS module, and glibc would allocate 16 more
 * bytes for every new thread's DTV, an allocation the program makes only because of
 * heapprofd. The key's destructor reports the thread's last records and hands its
 * state to the next thread (which keeps its known stacks and its reply slot: both
 * hold for any thread of the process).
 */
static unsigned thread_key;
static struct thread_state *spare_states;
static int spare_lock;
/* The state of threads that could get none (no memory): it passes every call on. */
static struct thread_state no_state = { .depth = 1u << 30 };

static struct thread_state *adopt_thread(void);
static struct thread_state *renew_thread(struct thread_state *t);

/* Counts the joins of an injected library (0 in launch mode): a thread's state from an
 * earlier heapprofd session (its queue registered, its known stacks hashed by that
 * session's program) starts afresh in the next. */
static uint32_t session;

static inline struct thread_state *this_thread(void)
{
    struct thread_state *t = pthread_getspecific(thread_key);
    if (likely(t != NULL) && likely(t->session == __atomic_load_n(&session, __ATOMIC_RELAXED)))
        return t;
    return t ? renew_thread(t) : adopt_thread();
}

/* ---- the real functions --------------------------------------------------------- */

/* heapprofd's mark in its copy of this file when it injects it into a running process
 * (`--pid`), where no LD_PRELOAD put it first: the constructor then does nothing, and
 * heapprofd_join starts it. Initialized, so that it is in the file. */
#define LAUNCHED_MARK 0x4c41554eu /* "LAUN" */
EXPORT volatile uint32_t heapprofd_injected = LAUNCHED_MARK;

static inline int injected(void) { return heapprofd_injected != LAUNCHED_MARK; }

enum state { UNINITIALIZED, INITIALIZING, ACTIVE, INERT };
static volatile int state = UNINITIALIZED;
static uint64_t sample_rate;
static uint64_t page_size = 4096;
/* The C++ operators are libstdc++'s, which allocate through malloc: pass through. */
static int cxx_through_malloc = 1;
/* The program's answers (the REPLIES map), or NULL: then every allocation probes. */
static struct hp_stack_reply *replies;
/* Else the object defining them (their calls of each other are nested). */
static void *cxx_base;
/* The code of the object serving malloc: a call made inside a real allocator call
 * from there is the allocator's own; from anywhere else (a signal handler that
 * interrupted it) it is the program's. Both 0: every such call is the allocator's. */
static uint64_t allocator_text_start, allocator_text_end;

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

/* The linker's marks: this object's first byte and the end of its code. */
extern const char __ehdr_start[] __attribute__((visibility("hidden")));
extern const char etext[] __attribute__((visibility("hidden")));

/* Whether `ra` is in no loaded object: the kernel's return-probe trampoline, which
 * another tool's return probe on the real function put in place of its return
 * address (a signal handler's code is in the program or a library). */
static __attribute__((noinline)) int in_no_object(uint64_t ra)
{
    dl_info_t info;
    return !dladdr((void *)(uintptr_t)ra, &info);
}

/* Whether a call inside a real allocator call, returning to `ra`, is the allocator's
 * own (it passes through) rather than a signal handler's. A real function that ends
 * in a tail call of another (glibc's reallocarray jumps to realloc) returns where the
 * real function would have: to the wrapper that called it, in this library's code,
 * or, when another tool has a return probe on it, to the kernel's trampoline. */
static inline int from_allocator(uint64_t ra)
{
    return allocator_text_end == 0 || (ra >= allocator_text_start && ra < allocator_text_end) ||
           (ra >= (uint64_t)(uintptr_t)__ehdr_start && ra < (uint64_t)(uintptr_t)etext) ||
           in_no_object(ra);
}


static struct {
    void *(*malloc)(size_t);
    void *(*calloc)(size_t, size_t);
    void *(*realloc)(void *, size_t);
    void *(*reallocarray)(void *, size_t, size_t);
    int (*posix_memalign)(void **, size_t, size_t);
    void *(*aligned_alloc)(size_t, size_t);
    void *(*memalign)(size_t, size_t);
    void *(*valloc)(size_t);
    void *(*pvalloc)(size_t);
    void (*free)(void *);
    void *(*cxx_new[8])();
    void (*cxx_delete[12])();
} real;

/* ---- the start-up arena ---------------------------------------------------------- */

/* Serves the allocations made while the real functions are looked up (dlsym's error
 * buffer); its blocks are never freed. Each has a 16-byte header with its size. */
static char arena[65536] __attribute__((aligned(16)));
static size_t arena_used;

static void *arena_alloc(size_t size, int zero)
{
    (void)zero; /* static memory starts zeroed and is never reused */
    size_t need = (size + 16 + 15) & ~(size_t)15;
    size_t at = __atomic_fetch_add(&arena_used, need, __ATOMIC_RELAXED);
    if (at + need > sizeof arena || need < size)
        return NULL;
    *(size_t *)(arena + at) = size;
    return arena + at + 16;
}

static inline int in_arena(const void *p)
{
    return (const char *)p >= arena && (const char *)p < arena + sizeof arena;
}

static inline size_t arena_size(const void *p) { return *(const size_t *)((const char *)p - 16); }

/* ---- sampling ----------------------------------------------------------------------- */

/* -ln(u) for u in (0, 1]: ln(m * 2^e) with m in [1, 2), ln(m) by the atanh series. */
static double neg_log(double u)
{
    union { double d; uint64_t bits; } v = { .d = u };
    int exponent = (int)((v.bits >> 52) & 0x7ff) - 1023;
    v.bits = (v.bits & ((1ULL << 52) - 1)) | (1023ULL << 52);
    double s = (v.d - 1) / (v.d + 1), s2 = s * s;
    double ln_m = 2 * s * (1 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 / 9))));
    return -(exponent * 0.6931471805599453 + ln_m);
}

static uint64_t next_random(struct thread_state *t)
{
    if (t->random == 0)
        t->random = (uint64_t)(uintptr_t)t ^ 0x9e3779b97f4a7c15ULL;
    t->random ^= t->random << 13;
    t->random ^= t->random >> 7;
    t->random ^= t->random << 17;
    return t->random;
}

/* Bytes until the next sampled allocation: exponential with mean sample_rate. */
static uint64_t draw(struct thread_state *t)
{
    double u = (double)((next_random(t) >> 11) + 1) / 9007199254740992.0;
    uint64_t bytes = (uint64_t)(neg_log(u) * (double)sample_rate);
    return bytes ? bytes : 1;
}

/* Whether an allocation of `size` bytes is sampled (Poisson over bytes, as Go's and
 * tcmalloc's heap profilers). */
static inline int sampled(struct thread_state *t, uint64_t size)
{
    if (t->until_sample == 0)
        t->until_sample = draw(t);
    if (size < t->until_sample) {
        t->until_sample -= size;
        return 0;
    }
    t->until_sample = draw(t);
    return 1;
}

/* The sampled blocks still allocated: open addressing, at most PROBE_LIMIT slots from
 * a block's home. A full neighbourhood makes the set "saturated": from then on every
 * free is reported (the program ignores blocks it does not know), never one missed. */
#define SET_SLOTS (1u << 17)
#define PROBE_LIMIT 64
#define SET_EMPTY 0
#define SET_TOMBSTONE 1
static uint64_t *sampled_set;
static int set_saturated;

static inline uint32_t set_home(uint64_t p)
{
    return (uint32_t)((p * 0x9e3779b97f4a7c15ULL) >> 47) & (SET_SLOTS - 1);
}

static void set_insert(uint64_t p)
{
    if (!sampled_set) {
        set_saturated = 1;
        return;
    }
    uint32_t home = set_home(p);
    for (uint32_t i = 0; i < PROBE_LIMIT; i++) {
        uint64_t *slot = &sampled_set[(home + i) & (SET_SLOTS - 1)];
        uint64_t seen = __atomic_load_n(slot, __ATOMIC_RELAXED);
        while (seen == SET_EMPTY || seen == SET_TOMBSTONE) {
            if (__atomic_compare_exchange_n(slot, &seen, p, 0, __ATOMIC_RELAXED,
                                            __ATOMIC_RELAXED))
                return;
        }
    }
    __atomic_store_n(&set_saturated, 1, __ATOMIC_RELAXED);
}

/* Whether `p` was sampled (then forgotten), or may have been. */
static inline int set_remove(uint64_t p)
{
    if (sampled_set) {
        uint32_t home = set_home(p);
        for (uint32_t i = 0; i < PROBE_LIMIT; i++) {
            uint64_t *slot = &sampled_set[(home + i) & (SET_SLOTS - 1)];
            uint64_t seen = __atomic_load_n(slot, __ATOMIC_RELAXED);
            if (seen == p)
                return __atomic_compare_exchange_n(slot, &seen, SET_TOMBSTONE, 0,
                                                   __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            if (seen == SET_EMPTY)
                break;
        }
    }
    return __atomic_load_n(&set_saturated, __ATOMIC_RELAXED);
}

/* ---- reporting ---------------------------------------------------------------------- */

/* The thread's slot of `replies`, taken on first use; 0 if it has none. */
static inline uint32_t reply_slot(struct thread_state *t)
{
    if (likely(t->reply_slot))
        return t->reply_slot == NO_SLOT ? 0 : t->reply_slot;
    if (!replies)
        return 0;
    /* Slot 0's hash counts the slots taken, by every process sharing the map. */
    uint64_t taken = __atomic_add_fetch(&replies[0].hash, 1, __ATOMIC_RELAXED);
    t->reply_slot = taken < HP_REPLY_SLOTS ? (uint32_t)taken : NO_SLOT;
    return t->reply_slot == NO_SLOT ? 0 : t->reply_slot;
}

static inline uint64_t meta(struct thread_state *t, unsigned function, unsigned kind)
{
    uint64_t word = function | (uint64_t)kind << HP_META_KIND_SHIFT |
                    (uint64_t)t->queue.len << HP_META_COUNT_SHIFT;
    if (!t->registered && !t->closing)
        word |= HP_META_REGISTER_QUEUE;
    return word;
}

/* The queue is about to change. A signal handler that allocates or frees meanwhile
 * (an interrupted append would be overwritten, an interrupted report would drop what
 * the handler queued) reports its call at once, leaving the queue alone (see
 * report_now, queue_free). Counted: the sections nest (a full queue's flush). */
static inline void busy_begin(struct thread_state *t)
{
    t->queue_busy++;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

static inline void busy_end(struct thread_state *t)
{
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    t->queue_busy--;
}

/* The queue was reported: it starts again, as a new generation. The program may read
 * it whenever the thread is switched out, so the order of these stores matters: an
 * emptied queue of the old generation is nothing new to it, a full one of the new
 * generation would be applied twice. */
static inline void reported(struct thread_state *t)
{
    t->queue.len = 0;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    t->queue.generation++;
    t->registered = !t->closing;
}

static inline uint64_t queue_address(struct thread_state *t)
{
    return (uint64_t)(uintptr_t)&t->queue;
}

/* Reports the queued records alone. */
static __attribute__((noinline)) void flush(struct thread_state *t)
{
    if (t->queue.len == 0)
        return;
    /* Once closing, the queue is known to the program only for this report. */
    uint64_t closing = t->closing ? HP_META_REGISTER_QUEUE | HP_META_UNREGISTER_QUEUE : 0;
    busy_begin(t);
    probe(0, 0, 0, 0, 0, queue_address(t), meta(t, 0, HP_KIND_FLUSH) | closing);
    reported(t);
    busy_end(t);
}

/* Queues a record of `words` words, reporting the queue first if it has no room. */
static inline void queue_record(struct thread_state *t, const uint64_t *record, uint32_t words)
{
    busy_begin(t);
    if (t->queue.len + words > HP_QUEUE_WORDS)
        flush(t);
    uint32_t at = t->queue.len;
    for (uint32_t i = 0; i < words; i++)
        t->queue.words[at + i] = record[i];
    /* The words before the length that covers them (see reported()). */
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    t->queue.len = at + words;
    /* Sampled, the few records are reported at once: heapprofd then needs no program
     * on every context switch and system call of the host to apply queues (the cost
     * of those is most of what a sampled session adds). */
    if (unlikely(t->closing) || sample_rate)
        flush(t);
    busy_end(t);
}

/* Queues the free of `p` (a block of the real allocator, not NULL). */
static inline void queue_free(struct thread_state *t, void *p)
{
    if (unlikely(t == &no_state))
        return;
    uint64_t block = (uint64_t)(uintptr_t)p;
    if (sample_rate && !set_remove(block))
        return;
    if (unlikely(t->queue_busy)) {
        /* A signal handler's free, while the thread it interrupted changes its queue. */
        probe(block, 0, 0, 0, 0, queue_address(t), meta(t, 0, HP_KIND_FREE) | HP_META_QUEUE_BUSY);
        return;
    }
    if (likely(!(block & HP_RECORD_EXTENDED))) {
        queue_record(t, &block, 1);
        return;
    }
    uint64_t record[3] = { HP_RECORD_EXTENDED | HP_RECORD_FREE, block, 0 };
    queue_record(t, record, HP_RECORD_EXTENDED_WORDS);
}

typedef uint64_t __attribute__((may_alias)) stack_word;

/* The known stack of a caller with these registers, or NULL. */
static inline const struct known_stack *find_known(struct thread_state *t, uint64_t ra,
                                                   uint64_t cfa, uint64_t fp);

/* Whether `k` is the stack of a caller with these registers: the words its walk read
 * are checked in walk order, so each place is read only after the words that led the
 * walk there were found unchanged. */
static inline int still_known(const struct known_stack *k, uint64_t ra, uint64_t cfa,
                              uint64_t fp)
{
    if (k->ra != ra || k->cfa != cfa || (k->uses_fp && k->fp != fp))
        return 0;
    for (uint32_t i = 0; i < k->reads; i++)
        if (*(const stack_word *)(uintptr_t)(cfa + (int64_t)k->offsets[i]) != k->values[i])
            return 0;
    return 1;
}

/* Keeps the program's answer to the last report, if it gave one. */
static __attribute__((noinline)) void remember(struct thread_state *t,
                                               const struct hp_stack_reply *reply, uint64_t ra,
                                               uint64_t cfa, uint64_t fp)
{
    if (reply->status != HP_REPLY_KNOWN || reply->reads > HP_REPLY_READS)
        return;
    for (uint32_t i = 0; i < reply->reads; i++)
        if (reply->offsets[i] < 0) /* below the caller's frame: not the caller's */
            return;
    uint32_t at = t->known_victim;
    t->known_victim = (at + 1) % KNOWN_STACKS;
    struct known_stack *k = &t->known[at];
    /* Emptied while it changes: a signal handler allocating meanwhile passes it by. */
    t->known_ra[at] = 0;
    k->ra = 0;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    k->cfa = cfa;
    k->fp = fp;
    k->hash = reply->hash;
    k->uses_fp = reply->uses_fp;
    k->reads = reply->reads;
    for (uint32_t i = 0; i < reply->reads; i++) {
        k->offsets[i] = reply->offsets[i];
        k->values[i] = *(const stack_word *)(uintptr_t)(cfa + (int64_t)reply->offsets[i]);
    }
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    k->ra = ra;
    t->known_ra[at] = ra;
}

static inline const struct known_stack *find_known(struct thread_state *t, uint64_t ra,
                                                   uint64_t cfa, uint64_t fp)
{
    for (uint32_t i = 0; i < KNOWN_STACKS; i++)
        if (t->known_ra[i] == ra && still_known(&t->known[i], ra, cfa, fp))
            return &t->known[i];
    return NULL;
}

/* Reports an allocation of `size` bytes at `p` by wrapped function `function`, with
 * the caller's registers: queued if its stack is known, else through the probe site. */
static void injected_check(void);

/* Allocations of a thread between two injected_check()s. */
#define CHECK_EVERY 512

static inline void report(struct thread_state *t, unsigned function, void *p, uint64_t size,
                          uint64_t ra, uint64_t sp, uint64_t fp)
{
    if (!p || unlikely(t == &no_state))
        return;
    if (unlikely(t->until_check-- == 0)) {
        t->until_check = CHECK_EVERY;
        if (injected())
            injected_check();
    }
    if (sample_rate) {
        if (!sampled(t, size))
            return;
        set_insert((uint64_t)(uintptr_t)p);
    }
    if (unlikely(t->queue_busy)) {
        /* A signal handler's allocation, while the thread it interrupted changes its
         * queue: reported now, walked, with no answer kept. */
        probe((uint64_t)(uintptr_t)p, size, ra, sp, fp, queue_address(t),
              meta(t, function, HP_KIND_ALLOC) | HP_META_QUEUE_BUSY);
        return;
    }
    const struct known_stack *k;
    if (likely(size >> (64 - HP_RECORD_SIZE_SHIFT) == 0) && (k = find_known(t, ra, sp, fp))) {
        uint64_t record[3] = { HP_RECORD_EXTENDED | (uint64_t)function << HP_RECORD_FUNCTION_SHIFT |
                                   size << HP_RECORD_SIZE_SHIFT,
                               (uint64_t)(uintptr_t)p, k->hash };
        queue_record(t, record, HP_RECORD_EXTENDED_WORDS);
        return;
    }
    uint32_t slot = reply_slot(t);
    if (slot)
        replies[slot].status = 0;
    busy_begin(t);
    probe((uint64_t)(uintptr_t)p, size, ra, sp, fp, queue_address(t),
          meta(t, function, HP_KIND_ALLOC) | (uint64_t)slot << HP_META_SLOT_SHIFT);
    reported(t);
    busy_end(t);
    if (slot && replies[slot].status == HP_REPLY_KNOWN)
        remember(t, &replies[slot], ra, sp, fp);
}

/* ---- start-up ------------------------------------------------------------------------- */

/* Tells heapprofd that this library serves the process, and where its code is. */
static void hello(void)
{
    struct thread_state *t = this_thread();
    busy_begin(t);
    probe((uint64_t)(uintptr_t)__ehdr_start, (uint64_t)(uintptr_t)etext, 0, 0, 0,
          queue_address(t), meta(t, 0, HP_KIND_HELLO));
    reported(t);
    busy_end(t);
}

static void before_fork(void)
{
    if (state != ACTIVE)
        return;
    struct thread_state *t = pthread_getspecific(thread_key);
    if (t)
        flush(t);
}

/*
 * Linux 6.18 optimizes the uprobe on the probe site into a call of a
 * [uprobes-trampoline] page of the process, and a child created by fork inherits the
 * call but not that page: its first report would jump into nothing (seen: every
 * child of a process launched or joined with this library died of SIGSEGV). The
 * child puts the breakpoint of an unoptimized uprobe there instead, which the kernel
 * handles for it as before (and may optimize again, with a trampoline of its own).
 */
#if defined(__x86_64__)
extern const unsigned char hp_probe_site_local[] __attribute__((visibility("hidden")));
#endif

static void unoptimize_probe_site(void)
{
#if defined(__x86_64__)
    unsigned char *site = (unsigned char *)(uintptr_t)hp_probe_site_local;
    if (__atomic_load_n(site, __ATOMIC_RELAXED) != 0xe8 /* call rel32 */)
        return;
    uint64_t first = (uint64_t)(uintptr_t)site & ~(page_size - 1);
    uint64_t last = ((uint64_t)(uintptr_t)site + 4) & ~(page_size - 1);
    size_t length = (size_t)(last - first + page_size);
    const int read_exec = PROT_READ | 4, all = PROT_READ | PROT_WRITE | 4;
    if (mprotect((void *)(uintptr_t)first, length, all) != 0)
        return;
    __atomic_store_n(site, 0xcc, __ATOMIC_RELEASE);
    mprotect((void *)(uintptr_t)first, length, read_exec);
#endif
}

static void leave_in_child(void);

static void in_child(void)
{
    unoptimize_probe_site();
    if (injected() && state == ACTIVE) {
        leave_in_child();
        if (state != ACTIVE)
            return;
    }
    /* A new process with a new thread id: it says hello and registers its queue; its
     * stacks' hashes are the parent's (they are seeded with the process). Spare states
     * are the parent's threads': they stay, as the parent's reply slots do. */
    struct thread_state *t = state == ACTIVE ? pthread_getspecific(thread_key) : NULL;
    if (t && t != &no_state) {
        t->queue.len = 0;
        t->queue_busy = 0;
        t->registered = 0;
        /* The map is shared with the parent, whose thread keeps its slot. */
        t->reply_slot = 0;
        for (unsigned i = 0; i < KNOWN_STACKS; i++) {
            t->known_ra[i] = 0;
            t->known[i].ra = 0;
        }
    }
    spare_lock = 0;
    if (state == ACTIVE)
        hello();
}

/* A state for a thread that has none: a spare one, else new memory. */
static __attribute__((noinline)) struct thread_state *adopt_thread(void)
{
    while (__atomic_exchange_n(&spare_lock, 1, __ATOMIC_ACQUIRE))
        ;
    struct thread_state *t = spare_states;
    if (t)
        spare_states = t->next_spare;
    __atomic_store_n(&spare_lock, 0, __ATOMIC_RELEASE);
    if (t) {
        t->queue.len = 0;
        t->queue_busy = 0;
        t->closing = 0;
        t->registered = 0;
        t->depth = 0;
        t->cxx_depth = 0;
        t->until_sample = 0;
        t->next_spare = NULL;
        t->session = session;
    } else {
        void *fresh = mmap(NULL, sizeof(struct thread_state), PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (fresh == MAP_FAILED)
            return &no_state;
        t = fresh;
        t->session = session;
    }
    if (pthread_setspecific(thread_key, t) != 0) {
        t->next_spare = NULL;
        return &no_state; /* never on glibc or musl: the key exists */
    }
    return t;
}

/* A thread's state from an earlier join: what the last session's program knew of it
 * (its registered queue, its reply slot, the hashes of its known stacks) is forgotten. */
static __attribute__((noinline)) struct thread_state *renew_thread(struct thread_state *t)
{
    if (t == &no_state)
        return t;
    t->queue.len = 0;
    t->queue_busy = 0;
    t->registered = 0;
    t->closing = 0;
    t->reply_slot = 0;
    t->until_sample = 0;
    t->until_check = 0;
    for (unsigned i = 0; i < KNOWN_STACKS; i++) {
        t->known_ra[i] = 0;
        t->known[i].ra = 0;
    }
    t->session = __atomic_load_n(&session, __ATOMIC_RELAXED);
    return t;
}

/* The key's destructor: the thread ends. Its last records are reported and its queue
 * unregistered (the state will be another thread's), then the state is spare. */
static void thread_ends(void *value)
{
    struct thread_state *t = value;
    if (!t || t == &no_state)
        return;
    if (state == ACTIVE && (t->registered || t->queue.len)) {
        busy_begin(t);
        probe(0, 0, 0, 0, 0, queue_address(t),
              meta(t, 0, HP_KIND_FLUSH) | HP_META_UNREGISTER_QUEUE);
        reported(t);
        busy_end(t);
    }
    t->registered = 0;
    while (__atomic_exchange_n(&spare_lock, 1, __ATOMIC_ACQUIRE))
        ;
    t->next_spare = spare_states;
    spare_states = t;
    __atomic_store_n(&spare_lock, 0, __ATOMIC_RELEASE);
}

static void *next(const char *name) { return dlsym(RTLD_NEXT, name); }

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

/* The size of the program's answers in memory. */
#define REPLIES_BYTES ((size_t)HP_REPLY_SLOTS * sizeof(struct hp_stack_reply))

/* Maps the program's answers from `descriptor`, a BPF map; where an earlier join's
 * answers were (an injected library joins again), in their place. */
static void map_replies_fd(int descriptor)
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
static void find_real_functions(void *(*lookup)(const char *))
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
static void learn_allocator(void)
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

/* The set of sampled blocks, empty (an injected library's from an earlier join is
 * cleared: its blocks belonged to that session). */
static void prepare_sampling(void)
{
    set_saturated = 0;
    if (!sample_rate)
        return;
    if (sampled_set) {
        for (uint32_t i = 0; i < SET_SLOTS; i++)
            sampled_set[i] = SET_EMPTY;
        return;
    }
    void *set = mmap(NULL, SET_SLOTS * sizeof(uint64_t), PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    sampled_set = set == MAP_FAILED ? NULL : set;
}

/* Once per process: the handlers stay for its life (-z nodelete, no DSO handle). */
static void register_fork_handlers(void)
{
    static int registered;
    if (registered)
        return;
    registered = 1;
    if (__register_atfork)
        __register_atfork(before_fork, NULL, in_child, NULL);
    else if (pthread_atfork)
        pthread_atfork(before_fork, NULL, in_child);
}

static void start_followed(const struct hp_follow *follow);

static void initialize(void)
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

__attribute__((constructor)) static void on_load(void)
{
    if (state == UNINITIALIZED)
        initialize();
}

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

/* Whether the wrappers report; otherwise they pass the call on (or, before the real
 * functions are known, serve it from the arena). */
static inline __attribute__((always_inline)) int active(void)
{
    int now = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (likely(now == ACTIVE))
        return 1;
    if (now == UNINITIALIZED) {
        initialize();
        now = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    }
    return now == ACTIVE;
}

static inline int ready(void) { return __atomic_load_n(&state, __ATOMIC_ACQUIRE) >= ACTIVE; }

/* ---- the C functions -------------------------------------------------------------------- */

/* Whether a call passes through unreported: inside a real allocator call of the
 * thread, made by the allocator itself (a signal handler's call is the program's), or
 * a thread without state. */
static inline int passes_through(struct thread_state *t, uint64_t ra)
{
    return t->depth && (t == &no_state || from_allocator(ra));
}

/* Runs `call` as a real allocator call of this thread (nested calls pass through). */
#define REAL_CALL(t, call)                                                                 \
    ({                                                                                     \
        (t)->depth++;                                                                      \
        __typeof__(call) result_ = (call);                                                 \
        (t)->depth--;                                                                      \
        result_;                                                                           \
    })

EXPORT void *malloc(size_t size)
{
    if (unlikely(!active()))
        return ready() ? real.malloc(size) : arena_alloc(size, 0);
    struct thread_state *t = this_thread();
    if (passes_through(t, CALLER_RA()))
        return real.malloc(size);
    void *p = REAL_CALL(t, real.malloc(size));
    report(t, HP_FN_MALLOC, p, size, CALLER_RA(), CALLER_SP(), CALLER_FP());
    return p;
}

EXPORT void *calloc(size_t count, size_t size)
{
    if (unlikely(!active())) {
        if (ready())
            return real.calloc(count, size);
        size_t bytes;
        return __builtin_mul_overflow(count, size, &bytes) ? NULL : arena_alloc(bytes, 1);
    }
    struct thread_state *t = this_thread();
    if (passes_through(t, CALLER_RA()))
        return real.calloc(count, size);
    void *p = REAL_CALL(t, real.calloc(count, size));
    report(t, HP_FN_CALLOC, p, (uint64_t)count * size, CALLER_RA(), CALLER_SP(), CALLER_FP());
    return p;
}

/* A block of the start-up arena moved to the real allocator. */
static void *from_arena(void *old, size_t size)
{
    void *p = real.malloc ? real.malloc(size) : arena_alloc(size, 0);
    if (p) {
        size_t keep = arena_size(old) < size ? arena_size(old) : size;
        for (size_t i = 0; i < keep; i++)
            ((char *)p)[i] = ((char *)old)[i];
    }
    return p;
}

/* realloc's accounting: the old block goes once the call succeeded (or, for a request
 * of 0 bytes answered with NULL, freed it), then the new one comes. */
static inline void moved(struct thread_state *t, unsigned function, void *old, void *p,
                         uint64_t size, uint64_t ra, uint64_t sp, uint64_t fp)
{
    if (old && (p || size == 0))
        queue_free(t, old);
    report(t, function, p, size, ra, sp, fp);
}

EXPORT void *realloc(void *old, size_t size)
{
    if (unlikely(in_arena(old)))
        return from_arena(old, size);
    if (unlikely(!active()))
        return ready() ? real.realloc(old, size) : arena_alloc(size, 0);
    struct thread_state *t = this_thread();
    if (passes_through(t, CALLER_RA()))
        return real.realloc(old, size);
    void *p = REAL_CALL(t, real.realloc(old, size));
    moved(t, HP_FN_REALLOC, old, p, size, CALLER_RA(), CALLER_SP(), CALLER_FP());
    return p;
}

EXPORT void *reallocarray(void *old, size_t count, size_t size)
{
    size_t bytes;
    int overflow = __builtin_mul_overflow(count, size, &bytes);
    if (unlikely(in_arena(old)))
        return overflow ? NULL : from_arena(old, bytes);
    if (unlikely(!active()) || !real.reallocarray)
        return ready() && real.reallocarray ? real.reallocarray(old, count, size)
               : overflow                   ? NULL
                                            : realloc(old, bytes);
    struct thread_state *t = this_thread();
    if (passes_through(t, CALLER_RA()))
        return real.reallocarray(old, count, size);
    void *p = REAL_CALL(t, real.reallocarray(old, count, size));
    moved(t, HP_FN_REALLOCARRAY, old, p, overflow ? 0 : bytes, CALLER_RA(), CALLER_SP(),
          CALLER_FP());
    return p;
}

EXPORT int posix_memalign(void **out, size_t alignment, size_t size)
{
    if (unlikely(!active()) || !real.posix_memalign) {
        if (ready() && real.posix_memalign)
            return real.posix_memalign(out, alignment, size);
        return 12; /* ENOMEM: nothing aligned before start-up */
    }
    struct thread_state *t = this_thread();
    if (passes_through(t, CALLER_RA()))
        return real.posix_memalign(out, alignment, size);
    int error = REAL_CALL(t, real.posix_memalign(out, alignment, size));
    if (error == 0)
        report(t, HP_FN_POSIX_MEMALIGN, *out, size, CALLER_RA(), CALLER_SP(), CALLER_FP());
    return error;
}

/* The aligned allocators with (alignment, size) arguments, or (size) for valloc and
 * pvalloc: pass through before start-up and inside allocator calls. */
#define ALIGNED_WRAPPER(name, index, params, args, bytes)                                 \
    EXPORT void *name params                                                               \
    {                                                                                      \
        if (unlikely(!active()) || !real.name)                                             \
            return ready() && real.name ? real.name args : NULL;                           \
        struct thread_state *t = this_thread();                                            \
        if (passes_through(t, CALLER_RA()))                                       \
            return real.name args;                                                         \
        void *p = REAL_CALL(t, real.name args);                                            \
        report(t, index, p, bytes, CALLER_RA(), CALLER_SP(), CALLER_FP());                 \
        return p;                                                                          \
    }

ALIGNED_WRAPPER(aligned_alloc, HP_FN_ALIGNED_ALLOC, (size_t alignment, size_t size),
                (alignment, size), size)
ALIGNED_WRAPPER(memalign, HP_FN_MEMALIGN, (size_t alignment, size_t size), (alignment, size),
                size)
ALIGNED_WRAPPER(valloc, HP_FN_VALLOC, (size_t size), (size), size)
/* glibc hands out whole pages, and one page for 0 bytes. */
ALIGNED_WRAPPER(pvalloc, HP_FN_PVALLOC, (size_t size), (size),
                size ? (size + page_size - 1) / page_size * page_size : page_size)

EXPORT void free(void *p)
{
    if (unlikely(!p || in_arena(p)))
        return;
    if (unlikely(!active())) {
        if (ready())
            real.free(p);
        return; /* before start-up only arena blocks exist */
    }
    struct thread_state *t = this_thread();
    if (!passes_through(t, CALLER_RA()))
        queue_free(t, p);
    real.free(p);
}

EXPORT void cfree(void *p) { free(p); }

/* A thread ending the process without exit() reports its last frees first. */
EXPORT __attribute__((noreturn)) void _exit(int status)
{
    static void (*real_exit)(int);
    if (state == ACTIVE) {
        struct thread_state *t = pthread_getspecific(thread_key);
        if (t)
            flush(t);
    }
    if (!real_exit)
        real_exit = (void (*)(int))next("_exit");
    real_exit(status);
    __builtin_unreachable();
}

/* ---- the C++ operators -------------------------------------------------------------------- */

/*
 * libstdc++'s operators allocate with malloc: they are passed through as tail calls
 * (no frame of this library on the stack, none an exception crosses) and malloc
 * reports, with the same stacks as without this library. Operators of a replacement
 * allocator (tcmalloc, jemalloc, mimalloc) allocate inside it: they are reported here.
 */
typedef void *(*new1_t)(size_t);
typedef void *(*new2_t)(size_t, uint64_t);
typedef void *(*new3_t)(size_t, uint64_t, uint64_t);
typedef void (*delete1_t)(void *);
typedef void (*delete2_t)(void *, uint64_t);
typedef void (*delete3_t)(void *, uint64_t, uint64_t);

/* Whether an operator call inside another one (its depth kept in the thread) comes
 * from the allocator's own code (operator new[] calling operator new): then the outer
 * call reports. An exception out of an operator leaves the depth raised; the check on
 * the caller keeps that from silencing the program's later calls. */
static __attribute__((noinline)) int cxx_nested(uint64_t ra)
{
    dl_info_t caller;
    return cxx_base && dladdr((void *)(uintptr_t)ra, &caller) && caller.dli_fbase == cxx_base;
}

#define NEW_WRAPPER(name, slot, type, params, args)                                       \
    EXPORT void *name params                                                               \
    {                                                                                      \
        type next_ = (type)real.cxx_new[slot];                                             \
        if (unlikely(!active()) || cxx_through_malloc || !next_)                           \
            return next_ ? next_ args : malloc(size);                                      \
        struct thread_state *t = this_thread();                                            \
        uint64_t ra = CALLER_RA();                                                         \
        if (t->cxx_depth && cxx_nested(ra))                                                \
            return next_ args;                                                             \
        t->cxx_depth++;                                                                    \
        void *p = next_ args;                                                              \
        t->cxx_depth--;                                                                    \
        report(t, HP_FN_FIRST_NEW + slot, p, size, ra, CALLER_SP(), CALLER_FP());          \
        return p;                                                                          \
    }

NEW_WRAPPER(_Znwm, 0, new1_t, (size_t size), (size))
NEW_WRAPPER(_Znam, 1, new1_t, (size_t size), (size))
NEW_WRAPPER(_ZnwmRKSt9nothrow_t, 2, new2_t, (size_t size, uint64_t a), (size, a))
NEW_WRAPPER(_ZnamRKSt9nothrow_t, 3, new2_t, (size_t size, uint64_t a), (size, a))
NEW_WRAPPER(_ZnwmSt11align_val_t, 4, new2_t, (size_t size, uint64_t a), (size, a))
NEW_WRAPPER(_ZnamSt11align_val_t, 5, new2_t, (size_t size, uint64_t a), (size, a))
NEW_WRAPPER(_ZnwmSt11align_val_tRKSt9nothrow_t, 6, new3_t, (size_t size, uint64_t a, uint64_t b),
            (size, a, b))
NEW_WRAPPER(_ZnamSt11align_val_tRKSt9nothrow_t, 7, new3_t, (size_t size, uint64_t a, uint64_t b),
            (size, a, b))

#define DELETE_WRAPPER(name, slot, type, params, args)                                    \
    EXPORT void name params                                                                \
    {                                                                                      \
        type next_ = (type)real.cxx_delete[slot];                                          \
        if (unlikely(!active()) || cxx_through_malloc || !next_) {                         \
            if (next_)                                                                     \
                next_ args;                                                                \
            else                                                                           \
                free(p);                                                                   \
            return;                                                                        \
        }                                                                                  \
        struct thread_state *t = this_thread();                                            \
        if (t->cxx_depth && cxx_nested(CALLER_RA())) {                                     \
            next_ args;                                                                    \
            return;                                                                        \
        }                                                                                  \
        if (p)                                                                             \
            queue_free(t, p);                                                              \
        t->cxx_depth++;                                                                    \
        next_ args;                                                                        \
        t->cxx_depth--;                                                                    \
    }

DELETE_WRAPPER(_ZdlPv, 0, delete1_t, (void *p), (p))
DELETE_WRAPPER(_ZdaPv, 1, delete1_t, (void *p), (p))
DELETE_WRAPPER(_ZdlPvm, 2, delete2_t, (void *p, uint64_t a), (p, a))
DELETE_WRAPPER(_ZdaPvm, 3, delete2_t, (void *p, uint64_t a), (p, a))
DELETE_WRAPPER(_ZdlPvRKSt9nothrow_t, 4, delete2_t, (void *p, uint64_t a), (p, a))
DELETE_WRAPPER(_ZdaPvRKSt9nothrow_t, 5, delete2_t, (void *p, uint64_t a), (p, a))
DELETE_WRAPPER(_ZdlPvSt11align_val_t, 6, delete2_t, (void *p, uint64_t a), (p, a))
DELETE_WRAPPER(_ZdaPvSt11align_val_t, 7, delete2_t, (void *p, uint64_t a), (p, a))
DELETE_WRAPPER(_ZdlPvmSt11align_val_t, 8, delete3_t, (void *p, uint64_t a, uint64_t b),
               (p, a, b))
DELETE_WRAPPER(_ZdaPvmSt11align_val_t, 9, delete3_t, (void *p, uint64_t a, uint64_t b),
               (p, a, b))
DELETE_WRAPPER(_ZdlPvSt11align_val_tRKSt9nothrow_t, 10, delete3_t,
               (void *p, uint64_t a, uint64_t b), (p, a, b))
DELETE_WRAPPER(_ZdaPvSt11align_val_tRKSt9nothrow_t, 11, delete3_t,
               (void *p, uint64_t a, uint64_t b), (p, a, b))

/* ---- joining a running process ---------------------------------------------------------- */

/*
 * `heapprofd --pid` loads this library into a running process (ptrace, dlopen) and
 * calls heapprofd_join: the real functions are the ones the process's global scope
 * binds, and the slots its objects call them through are pointed at the wrappers
 * (got.c). heapprofd_leave puts the slots back; the library then passes every call
 * that still reaches it straight on, and a later heapprofd joins the same copy again.
 */

/* The wrappers' own addresses (an exported name used here would bind to the
 * process's definition). */
#define LOCAL_ALIAS(name) extern __typeof__(name) hp_local_##name __attribute__((alias(#name), visibility("hidden"), copy(name)));
LOCAL_ALIAS(malloc)
LOCAL_ALIAS(calloc)
LOCAL_ALIAS(realloc)
LOCAL_ALIAS(reallocarray)
LOCAL_ALIAS(posix_memalign)
LOCAL_ALIAS(aligned_alloc)
LOCAL_ALIAS(memalign)
LOCAL_ALIAS(valloc)
LOCAL_ALIAS(pvalloc)
LOCAL_ALIAS(free)
LOCAL_ALIAS(_Znwm)
LOCAL_ALIAS(_Znam)
LOCAL_ALIAS(_ZnwmRKSt9nothrow_t)
LOCAL_ALIAS(_ZnamRKSt9nothrow_t)
LOCAL_ALIAS(_ZnwmSt11align_val_t)
LOCAL_ALIAS(_ZnamSt11align_val_t)
LOCAL_ALIAS(_ZnwmSt11align_val_tRKSt9nothrow_t)
LOCAL_ALIAS(_ZnamSt11align_val_tRKSt9nothrow_t)
LOCAL_ALIAS(_ZdlPv)
LOCAL_ALIAS(_ZdaPv)
LOCAL_ALIAS(_ZdlPvm)
LOCAL_ALIAS(_ZdaPvm)
LOCAL_ALIAS(_ZdlPvRKSt9nothrow_t)
LOCAL_ALIAS(_ZdaPvRKSt9nothrow_t)
LOCAL_ALIAS(_ZdlPvSt11align_val_t)
LOCAL_ALIAS(_ZdaPvSt11align_val_t)
LOCAL_ALIAS(_ZdlPvmSt11align_val_t)
LOCAL_ALIAS(_ZdaPvmSt11align_val_t)
LOCAL_ALIAS(_ZdlPvSt11align_val_tRKSt9nothrow_t)
LOCAL_ALIAS(_ZdaPvSt11align_val_tRKSt9nothrow_t)

/* The slots redirected: the C functions, and C++'s operators when they do not
 * allocate with malloc (libstdc++'s do: malloc's wrapper sees their calls). */
static struct got_target redirected[48];
static unsigned redirected_count;

static void add_target(const char *name, void *original, void *replacement)
{
    if (original && redirected_count < sizeof redirected / sizeof redirected[0])
        redirected[redirected_count++] = (struct got_target){ name, original, replacement };
}

static void choose_alloc_targets(void);

/* The exec functions, so that an exec takes the library along (exec_follow.c). */
static void choose_exec_targets(void)
{
    unsigned room = sizeof redirected / sizeof redirected[0] - redirected_count;
    redirected_count += hp_exec_targets(redirected + redirected_count, room);
}

static void choose_targets(void)
{
    redirected_count = 0;
    choose_alloc_targets();
    choose_exec_targets();
}

static void choose_alloc_targets(void)
{
    add_target("malloc", (void *)real.malloc, (void *)hp_local_malloc);
    add_target("calloc", (void *)real.calloc, (void *)hp_local_calloc);
    add_target("realloc", (void *)real.realloc, (void *)hp_local_realloc);
    add_target("reallocarray", (void *)real.reallocarray, (void *)hp_local_reallocarray);
    add_target("posix_memalign", (void *)real.posix_memalign, (void *)hp_local_posix_memalign);
    add_target("aligned_alloc", (void *)real.aligned_alloc, (void *)hp_local_aligned_alloc);
    add_target("memalign", (void *)real.memalign, (void *)hp_local_memalign);
    add_target("valloc", (void *)real.valloc, (void *)hp_local_valloc);
    add_target("pvalloc", (void *)real.pvalloc, (void *)hp_local_pvalloc);
    add_target("free", (void *)real.free, (void *)hp_local_free);
    if (cxx_through_malloc)
        return;
    void *news[8] = { (void *)hp_local__Znwm,
                      (void *)hp_local__Znam,
                      (void *)hp_local__ZnwmRKSt9nothrow_t,
                      (void *)hp_local__ZnamRKSt9nothrow_t,
                      (void *)hp_local__ZnwmSt11align_val_t,
                      (void *)hp_local__ZnamSt11align_val_t,
                      (void *)hp_local__ZnwmSt11align_val_tRKSt9nothrow_t,
                      (void *)hp_local__ZnamSt11align_val_tRKSt9nothrow_t };
    void *deletes[12] = { (void *)hp_local__ZdlPv,
                          (void *)hp_local__ZdaPv,
                          (void *)hp_local__ZdlPvm,
                          (void *)hp_local__ZdaPvm,
                          (void *)hp_local__ZdlPvRKSt9nothrow_t,
                          (void *)hp_local__ZdaPvRKSt9nothrow_t,
                          (void *)hp_local__ZdlPvSt11align_val_t,
                          (void *)hp_local__ZdaPvSt11align_val_t,
                          (void *)hp_local__ZdlPvmSt11align_val_t,
                          (void *)hp_local__ZdaPvmSt11align_val_t,
                          (void *)hp_local__ZdlPvSt11align_val_tRKSt9nothrow_t,
                          (void *)hp_local__ZdaPvSt11align_val_tRKSt9nothrow_t };
    for (unsigned i = 0; i < 8; i++)
        add_target(hp_function_names[HP_FN_FIRST_NEW + i], (void *)real.cxx_new[i], news[i]);
    for (unsigned i = 0; i < 12; i++)
        add_target(hp_function_names[HP_FN_FIRST_DELETE + i], (void *)real.cxx_delete[i],
                   deletes[i]);
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
static void leave_in_child(void)
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
static void start_followed(const struct hp_follow *follow)
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
static __attribute__((noinline)) void injected_check(void)
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
