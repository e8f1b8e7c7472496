/*
 * Joining a running process and leaving it (join.c): what the other parts call.
 */
#pragma once

#include "exec_follow.h"

#pragma GCC visibility push(hidden)

/* Now and then (every CHECK_EVERY allocations of a thread): leaves if heapprofd has
 * died without detaching, and redirects the slots of objects loaded since the last
 * look (dlopen). */
void injected_check(void);
/* A forked child of a joined process that heapprofd does not trace: its calls pass on. */
void leave_in_child(void);
/* The image a following exec started: joined from its first call, like a launched
 * program, with what the exec handed over. */
void start_followed(const struct hp_follow *follow);

#pragma GCC visibility pop
