/*
 * The wrappers (wrappers.c): what the join needs of them.
 */
#pragma once

#include "got.h"

#pragma GCC visibility push(hidden)

/* Adds the allocation functions the process binds (their real addresses and the
 * wrappers) to `targets`, which has `room` entries; returns how many were added: the
 * C functions, and C++'s operators when they do not allocate with malloc (libstdc++'s
 * do: malloc's wrapper sees their calls). */
unsigned alloc_targets(struct got_target *targets, unsigned room);

#pragma GCC visibility pop
