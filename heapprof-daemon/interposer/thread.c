/*
 * Each thread's state, found through a pthread key, not thread-local storage: a TLS
 * block would make this library one more TLS module, and glibc would allocate 16 more
 * bytes for every new thread's DTV, an allocation the program makes only because of
 * heapprofd. The key's destructor (report.c's thread_ends) reports the thread's last
 * records and hands its state to the next thread (which keeps its known stacks and
 * its reply slot: both hold for any thread of the process).
 */
#include "thread.h"

unsigned thread_key;
static struct thread_state *spare_states;
int spare_lock;
struct thread_state no_state = { .depth = 1u << 30 };
uint32_t session;

/* A state for a thread that has none: a spare one, else new memory. */
__attribute__((noinline)) struct thread_state *adopt_thread(void)
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
__attribute__((noinline)) struct thread_state *renew_thread(struct thread_state *t)
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

/* Makes `t` spare: the next thread without a state takes it. */
void spare_thread(struct thread_state *t)
{
    while (__atomic_exchange_n(&spare_lock, 1, __ATOMIC_ACQUIRE))
        ;
    t->next_spare = spare_states;
    spare_states = t;
    __atomic_store_n(&spare_lock, 0, __ATOMIC_RELEASE);
}
