/*
 * The library's start in a process (lifecycle.c): what the join reuses of it, and
 * whether the wrappers report now (starting the library at the first call).
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "state.h"

#pragma GCC visibility push(hidden)

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
/* Adds the exec functions to the slots redirected, so that an exec takes the library
 * along (exec_follow.c). */
void choose_exec_targets(void);

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
