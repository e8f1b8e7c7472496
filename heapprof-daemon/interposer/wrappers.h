/*
 * The wrappers (wrappers.c): what the start-up and the join need of them.
 */
#pragma once

#include "got.h"

#pragma GCC visibility push(hidden)

/* Finds the code of the object serving malloc, loaded at `base`: a call made inside a
 * real allocator call from there is the allocator's own. */
void find_allocator_text(const unsigned char *base);

/* Adds the allocation functions the process binds (their real addresses and the
 * wrappers) to `targets`, which has `room` entries; returns how many were added: the
 * C functions, and C++'s operators when they do not allocate with malloc (libstdc++'s
 * do: malloc's wrapper sees their calls). */
unsigned alloc_targets(struct got_target *targets, unsigned room);

#pragma GCC visibility pop
