/*
 * The wrappers of the C allocation functions and the C++ operators: each calls the
 * real function, then reports (report.c), unless the call passes through (inside a
 * real allocator call, or before start-up, when the start-up arena serves it).
 */
#include "wrappers.h"

#include "interposer.h"
#include "joined.h"
#include "lifecycle.h"
#include "preload_abi.h"
#include "probe_site.h"
#include "report.h"
#include "state.h"
#include "thread.h"

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

/* ---- reporting, and the join's look now and then -------------------------------------- */

/* Allocations of a thread between two injected_check()s. */
#define CHECK_EVERY 512

/* Reports an allocation (report.c); every CHECK_EVERY allocations of a thread, an
 * injected library first looks whether heapprofd still holds the join (joined.c). */
static inline void report_checked(struct thread_state *t, unsigned function, void *p,
                                  uint64_t size, uint64_t ra, uint64_t sp, uint64_t fp)
{
    if (p && likely(t != &no_state) && unlikely(t->until_check-- == 0)) {
        t->until_check = CHECK_EVERY;
        if (injected())
            injected_check();
    }
    report(t, function, p, size, ra, sp, fp);
}

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

WRAPPER void *malloc(size_t size)
{
    if (unlikely(!active()))
        return ready() ? real.malloc(size) : arena_alloc(size, 0);
    struct thread_state *t = this_thread();
    if (passes_through(t, CALLER_RA()))
        return real.malloc(size);
    void *p = REAL_CALL(t, real.malloc(size));
    report_checked(t, HP_FN_MALLOC, p, size, CALLER_RA(), CALLER_SP(), CALLER_FP());
    return p;
}

WRAPPER void *calloc(size_t count, size_t size)
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
    report_checked(t, HP_FN_CALLOC, p, (uint64_t)count * size, CALLER_RA(), CALLER_SP(),
                   CALLER_FP());
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
    report_checked(t, function, p, size, ra, sp, fp);
}

WRAPPER void *realloc(void *old, size_t size)
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

WRAPPER void *reallocarray(void *old, size_t count, size_t size)
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

WRAPPER int posix_memalign(void **out, size_t alignment, size_t size)
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
        report_checked(t, HP_FN_POSIX_MEMALIGN, *out, size, CALLER_RA(), CALLER_SP(),
                       CALLER_FP());
    return error;
}

/* The aligned allocators with (alignment, size) arguments, or (size) for valloc and
 * pvalloc: pass through before start-up and inside allocator calls. */
#define ALIGNED_WRAPPER(name, index, params, args, bytes)                                 \
    WRAPPER void *name params                                                               \
    {                                                                                      \
        if (unlikely(!active()) || !real.name)                                             \
            return ready() && real.name ? real.name args : NULL;                           \
        struct thread_state *t = this_thread();                                            \
        if (passes_through(t, CALLER_RA()))                                       \
            return real.name args;                                                         \
        void *p = REAL_CALL(t, real.name args);                                            \
        report_checked(t, index, p, bytes, CALLER_RA(), CALLER_SP(), CALLER_FP());         \
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

WRAPPER void free(void *p)
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

WRAPPER void cfree(void *p) { free(p); }

/* A thread ending the process without exit() reports its last frees first. */
WRAPPER __attribute__((noreturn)) void _exit(int status)
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
    WRAPPER void *name params                                                               \
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
        report_checked(t, HP_FN_FIRST_NEW + slot, p, size, ra, CALLER_SP(), CALLER_FP());  \
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
    WRAPPER void name params                                                                \
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

/* ---- joining: the wrappers as GOT targets ------------------------------------------------ */

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

/* The targets added so far, and the room left. */
struct target_list {
    struct got_target *at;
    unsigned room;
    unsigned count;
};

static void add_target(struct target_list *list, const char *name, void *original,
                       void *replacement)
{
    if (original && list->count < list->room)
        list->at[list->count++] = (struct got_target){ name, original, replacement };
}

unsigned alloc_targets(struct got_target *targets, unsigned room)
{
    struct target_list list = { targets, room, 0 };
    add_target(&list, "malloc", (void *)real.malloc, (void *)hp_local_malloc);
    add_target(&list, "calloc", (void *)real.calloc, (void *)hp_local_calloc);
    add_target(&list, "realloc", (void *)real.realloc, (void *)hp_local_realloc);
    add_target(&list, "reallocarray", (void *)real.reallocarray,
               (void *)hp_local_reallocarray);
    add_target(&list, "posix_memalign", (void *)real.posix_memalign,
               (void *)hp_local_posix_memalign);
    add_target(&list, "aligned_alloc", (void *)real.aligned_alloc,
               (void *)hp_local_aligned_alloc);
    add_target(&list, "memalign", (void *)real.memalign, (void *)hp_local_memalign);
    add_target(&list, "valloc", (void *)real.valloc, (void *)hp_local_valloc);
    add_target(&list, "pvalloc", (void *)real.pvalloc, (void *)hp_local_pvalloc);
    add_target(&list, "free", (void *)real.free, (void *)hp_local_free);
    if (cxx_through_malloc)
        return list.count;
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
        add_target(&list, hp_function_names[HP_FN_FIRST_NEW + i], (void *)real.cxx_new[i],
                   news[i]);
    for (unsigned i = 0; i < 12; i++)
        add_target(&list, hp_function_names[HP_FN_FIRST_DELETE + i],
                   (void *)real.cxx_delete[i], deletes[i]);
    return list.count;
}
