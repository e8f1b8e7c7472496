/*
 * Fork safety: before a fork the forking thread's queue is reported; in the child,
 * the queue, reply slot and known stacks start afresh (a new process, a new thread
 * id), the spare states' lock is free, the probe site is made safe to call, and the
 * child says hello. A joined process's child that heapprofd does not trace leaves
 * (joined.c).
 */
#include "fork.h"

#include "got.h"
#include "interposer.h"
#include "joined.h"
#include "probe_site.h"
#include "report.h"
#include "state.h"
#include "thread.h"

static void before_fork(void)
{
    if (state == ACTIVE) {
        struct thread_state *t = pthread_getspecific(thread_key);
        if (t)
            flush(t);
    }
    /* Last: no walk of the loader's list runs across the fork (got.h). */
    got_walk_hold_for_fork();
}

static void after_fork_in_parent(void)
{
    got_walk_release_after_fork();
}

/*
 * Linux 6.18 optimizes the uprobe on the probe site into a call of a
 * [uprobes-trampoline] page of the process, and a child created by fork inherits the
 * call but not that page: its first report would jump into nothing (seen: every
 * child of a process launched or joined with this library died of SIGSEGV). The
 * child puts the breakpoint of an unoptimized uprobe there instead, which the kernel
 * handles for it as before (and may optimize again, with a trampoline of its own).
 */
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

static void in_child(void)
{
    got_walk_release_after_fork();
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

/* Once per process: the handlers stay for its life (-z nodelete, no DSO handle). */
void register_fork_handlers(void)
{
    static int registered;
    if (registered)
        return;
    registered = 1;
    if (__register_atfork)
        __register_atfork(before_fork, after_fork_in_parent, in_child, NULL);
    else if (pthread_atfork)
        pthread_atfork(before_fork, after_fork_in_parent, in_child);
}
