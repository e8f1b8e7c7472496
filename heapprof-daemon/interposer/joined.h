/*
 * A joined process (joined.c): what the join holds while it lasts, the look now and
 * then, and leaving; and what a following exec hands the new image.
 */
#pragma once
#include <stdint.h>

#include "got.h"

/* What a following exec hands the new image. */
struct hp_follow {
    int library; /* the library's own file (a memfd) */
    int replies; /* the answers' map */
    int pidfd;   /* heapprofd */
    uint64_t rate;
    int children; /* forked children stay joined */
};

/* The lowest number the join's descriptors sit at, in the joined process and in the
 * image a following exec starts: programs place their own files at the low numbers
 * (a shell's `exec 6>&1`, a daemon's dup2 onto 3) and expect them as they left them. */
#define HP_FIRST_HIGH_DESCRIPTOR 100

/* The most slots redirected: the allocation functions and the exec functions. */
#define REDIRECTED_MOST 48

#pragma GCC visibility push(hidden)

/* The slots redirected: the C functions, and C++'s operators when they do not
 * allocate with malloc (libstdc++'s do: malloc's wrapper sees their calls); and the
 * exec functions. */
extern struct got_target redirected[REDIRECTED_MOST];
extern unsigned redirected_count;
/* heapprofd itself, while the library is joined: its exit makes it readable. */
extern int daemon_pidfd;
/* While joined, what an exec hands the new image: the library's own file and the
 * answers' map, and the process that joined, whose exec alone is followed. */
extern int library_fd, replies_fd;
extern int joined_pid;
/* Preloaded into the image a following exec started: the allocation functions are
 * bound to the wrappers already, only the exec functions are redirected. */
extern int followed;
/* Whether a forked child stays joined (heapprofd traces the process's children too). */
extern int children_joined;
/* Objects the loader had added when the slots were last rewritten. */
extern uint64_t loads_seen;

/* The objects the loader has added so far. */
uint64_t loader_adds(void);
/* Notes what the handed descriptors (daemon_pidfd, library_fd, replies_fd) are, once
 * they are in place: one the program later replaces (a dup2 onto its number) is then
 * neither polled nor closed. */
void remember_handed(void);
/* Whether the join is over: heapprofd has exited (its pidfd reads), or its pidfd's
 * number now holds a file of the program's (then forgotten, not closed). */
int daemon_gone(void);
/* Puts the slots back and passes every call on from now on; returns the slots put
 * back. */
long heapprofd_leave_now(void);
/* Now and then (every CHECK_EVERY allocations of a thread, see wrappers.c): leaves if
 * heapprofd has died without detaching, and redirects the slots of objects loaded
 * since the last look (dlopen). */
void injected_check(void);
/* A forked child of a joined process that heapprofd does not trace: its calls pass on. */
void leave_in_child(void);
/* 1 with `follow` filled while the process is joined and an exec should take the
 * library along (exec_follow.c), else 0. */
int hp_follow_state(struct hp_follow *follow);

#pragma GCC visibility pop
