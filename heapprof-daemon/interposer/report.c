/*
 * The per-thread queue and reporting: sampling (which allocations are reported, and
 * the set of sampled blocks whose frees are), the queue of records, the known stacks
 * that let an allocation be queued instead of probed, and the reports through the
 * probe site.
 */
#include "report.h"

#include "probe_site.h"
#include "state.h"
#include "thread.h"

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

/* Reports the queued records alone. */
__attribute__((noinline)) void flush(struct thread_state *t)
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
void queue_free(struct thread_state *t, void *p)
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

void report(struct thread_state *t, unsigned function, void *p, uint64_t size, uint64_t ra,
            uint64_t sp, uint64_t fp)
{
    if (!p || unlikely(t == &no_state))
        return;
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

/* Tells heapprofd that this library serves the process, and where its code is. */
void hello(void)
{
    struct thread_state *t = this_thread();
    busy_begin(t);
    probe((uint64_t)(uintptr_t)__ehdr_start, (uint64_t)(uintptr_t)etext, 0, 0, 0,
          queue_address(t), meta(t, 0, HP_KIND_HELLO));
    reported(t);
    busy_end(t);
}

/* The set of sampled blocks, empty (an injected library's from an earlier join is
 * cleared: its blocks belonged to that session). */
void prepare_sampling(void)
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

/* The key's destructor: the thread ends. Its last records are reported and its queue
 * unregistered (the state will be another thread's), then the state is spare. */
void thread_ends(void *value)
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
    spare_thread(t);
}
