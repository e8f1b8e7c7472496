/*
 * The library's state, which every part reads (state.c holds it): whether it is
 * active, the sample rate, the real functions and what they told of the allocator,
 * the program's answers. It calls nothing: the parts above set it.
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
/* The system-wide build's mark: like an injected copy, it waits for a join. */
#define SYSTEM_MARK 0x53595354u /* "SYST" */
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
/* The code of the object serving malloc: a call made inside a real allocator call
 * from there is the allocator's own; from anywhere else (a signal handler that
 * interrupted it) it is the program's. Both 0: every such call is the allocator's. */
extern uint64_t allocator_text_start, allocator_text_end;
extern struct real_functions real;

#pragma GCC visibility pop
