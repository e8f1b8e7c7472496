/*
 * Each thread's state: its report queue (read by the BPF program), its known stacks,
 * its sampling countdown. Found through a pthread key (thread.c says why not TLS).
 */
#pragma once
#include <stdint.h>

#include "interposer.h"
#include "preload_abi.h"

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

#pragma GCC visibility push(hidden)

extern unsigned thread_key;
/* Taken while `spare_states` changes (a forked child starts with it free). */
extern int spare_lock;
/* The state of threads that could get none (no memory): it passes every call on. */
extern struct thread_state no_state;
/* Counts the joins of an injected library (0 in launch mode): a thread's state from an
 * earlier heapprofd session (its queue registered, its known stacks hashed by that
 * session's program) starts afresh in the next. */
extern uint32_t session;

struct thread_state *adopt_thread(void);
struct thread_state *renew_thread(struct thread_state *t);
/* Makes `t` spare: the next thread without a state takes it. */
void spare_thread(struct thread_state *t);

#pragma GCC visibility pop

static inline struct thread_state *this_thread(void)
{
    struct thread_state *t = pthread_getspecific(thread_key);
    if (likely(t != NULL) && likely(t->session == __atomic_load_n(&session, __ATOMIC_RELAXED)))
        return t;
    return t ? renew_thread(t) : adopt_thread();
}
