/*
 * Redirecting a running process's calls by rewriting the slots its objects call
 * through (the GOT): how heapprofd's library joins a process it was injected into,
 * where the dynamic linker's binding order can no longer put it first.
 *
 * Kept apart from the interposer: this part knows ELF and the loader, nothing of
 * what the wrappers do.
 */
#pragma once
#include <stdint.h>

/* One function to redirect: the slots bound to `original` get `replacement`. */
struct got_target {
    const char *name;
    void *original;
    void *replacement;
};

/* What a pass over the loaded objects did. */
struct got_result {
    uint32_t rewritten;   /* slots changed */
    uint32_t unwritable;  /* slots left as they were: their page could not be made writable */
    uint32_t objects;     /* objects looked at */
};

/*
 * Every loaded object but the one at `self` (this library): each relocated slot
 * (PLT, GOT, absolute data pointer) naming one of the `count` targets is pointed at
 * the replacement when it holds the original or, for a PLT slot the lazy binder has
 * not resolved yet, the object's own code; with `restore`, slots holding the
 * replacement get the original back. Safe while other threads run: a slot is one
 * aligned word, written once. Passes are serialized: without `wait`, a pass asked
 * for while another runs is left to that one, which repeats itself (in its own mode).
 */
struct got_result got_rewrite(const struct got_target *targets, unsigned count, const void *self,
                              int restore, int wait);

/* The library's walks of the loader's list (dl_iterate_phdr, which holds the loader's
 * lock meanwhile) and fork: a forked child must never inherit that lock held by a walk
 * on a thread that did not come along, or its first walk waits for it forever (seen: a
 * joined process's forked child stuck in dl_iterate_phdr before its exec). */
/* Starts a walk if none runs (1), else 0: the caller skips it. */
int got_walk_try(void);
/* Starts a walk, waiting for one that runs. */
void got_walk_begin(void);
/* Ends a walk. */
void got_walk_end(void);
/* Before a fork: waits for the walk that runs and keeps others from starting. */
void got_walk_hold_for_fork(void);
/* After a fork, in the parent and in the child: walks may start again. */
void got_walk_release_after_fork(void);
