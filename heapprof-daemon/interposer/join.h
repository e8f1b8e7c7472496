/*
 * Joining heapprofd (join.c): through ptrace (heapprofd_join, --pid) or from the
 * system-wide copy's start (system.c), with the descriptors already received.
 */
#pragma once
#include <stdint.h>

#include "preload_abi.h"

/* heapprofd_join's flags: forked children stay joined (they are traced too). */
#define JOIN_CHILDREN HP_JOIN_CHILDREN

/* Why a join was refused: enum join_error, generated into preload_abi.h from
 * heapprof-common's JoinRefused. */

#pragma GCC visibility push(hidden)

/* Joins with the answers' map, heapprofd's pidfd and the library's own file (-1:
 * execs are not followed), which it then owns; `rate` and `flags` as
 * heapprofd_join's. Returns the slots redirected, or a join_error. */
long hp_join_with(int replies, int pidfd, int library, uint64_t rate, uint64_t flags);

#pragma GCC visibility pop
