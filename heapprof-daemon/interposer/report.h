/*
 * The per-thread queue and reporting (report.c): what the other parts call to report,
 * and the queue's small steps that the thread's start and end share. Signal safety
 * lives here too: a handler that allocates while its thread changes the queue reports
 * at once, leaving the queue alone (busy_begin).
 */
#pragma once
#include <stdint.h>

#include "preload_abi.h"
#include "thread.h"

#pragma GCC visibility push(hidden)

/* Reports the queued records alone. */
void flush(struct thread_state *t);
/* Queues the free of `p` (a block of the real allocator, not NULL). */
void queue_free(struct thread_state *t, void *p);
/* Reports an allocation of `size` bytes at `p` by wrapped function `function`, with
 * the caller's registers: queued if its stack is known, else through the probe site. */
void report(struct thread_state *t, unsigned function, void *p, uint64_t size, uint64_t ra,
            uint64_t sp, uint64_t fp);
/* Tells heapprofd that this library serves the process, and where its code is. */
void hello(void);
/* The set of sampled blocks, empty (an injected library's from an earlier join is
 * cleared: its blocks belonged to that session). */
void prepare_sampling(void);
/* The thread key's destructor: the thread ends. */
void thread_ends(void *value);

#pragma GCC visibility pop

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
