/*
 * The library's life in a process (lifecycle.c): its state, the real functions it
 * found, what it learnt of the allocator, the program's answers; and whether the
 * wrappers report now.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "interposer.h"
#include "preload_abi.h"

/* heapprofd's mark in its copy of this file when it injects it into a running process
 * (`--pid`), where no LD_PRELOAD put it first: the constructor then does nothing, and
 * heapprofd_join starts it. Initialized, so that it is in the file. */
#define LAUNCHED_MARK 0x4c41554eu /* "LAUN" */
EXPORT extern volatile uint32_t heapprofd_injected;

static inline int injected(void) { return heapprofd_injected != LAUNCHED_MARK; }

enum state { UNINITIALIZED, INITIALIZING, ACTIVE, INERT };

/* The real functions: the ones after this library in the binding order (launched),
 * or the ones the process's global scope binds (injected). */
struct real_functions {
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
};

/* The size of the program's answers in memory. */
#define REPLIES_BYTES ((size_t)HP_REPLY_SLOTS * sizeof(struct hp_stack_reply))

#pragma GCC visibility push(hidden)

extern volatile int state;
extern uint64_t sample_rate;
extern uint64_t page_size;
/* The C++ operators are libstdc++'s, which allocate through malloc: pass through. */
extern int cxx_through_malloc;
/* The program's answers (the REPLIES map), or NULL: then every allocation probes. */
extern struct hp_stack_reply *replies;
/* Else the object defining them (their calls of each other are nested). */
extern void *cxx_base;
extern struct real_functions real;

void initialize(void);
/* The definition of `name` after this library in the binding order. */
void *next(const char *name);
/* Maps the program's answers from `descriptor`, a BPF map; where an earlier join's
 * answers were (an injected library joins again), in their place. */
void map_replies_fd(int descriptor);
/* Looks up the real functions with `lookup`. */
void find_real_functions(void *(*lookup)(const char *));
/* What the real functions tell: whether C++'s operators allocate with malloc, where
 * the allocator's code is, and the page size. */
void learn_allocator(void);

#pragma GCC visibility pop

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
