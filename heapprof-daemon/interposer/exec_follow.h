/*
 * Following a joined process through exec: the exec functions' wrappers, and the
 * start of the library in the new image.
 *
 * A process heapprofd joined (`--pid`, injection) may exec another program. Nothing
 * of the injected library survives the exec, and heapprofd could only probe the new
 * image's allocator after the fact, missing its first allocations. So while joined,
 * the process's exec calls go through these wrappers: they hand the new image the
 * library (LD_PRELOAD of its descriptor), the answers' map, heapprofd's pidfd and the
 * sample rate, as launch mode would, and the new image's copy removes all of it from
 * the environment at start. Kept apart from the interposer: this part knows the
 * environment and descriptors, nothing of the allocations.
 */
#pragma once
#include <stdint.h>

/* What a following exec hands the new image (struct hp_follow), and whether an exec
 * takes the library along (hp_follow_state): joined.c. */
#include "joined.h"

/* Adds the exec functions the process binds (their real addresses and the wrappers)
 * to `targets`, which has `room` entries; returns how many were added. */
unsigned hp_exec_targets(struct got_target *targets, unsigned room);

/*
 * In a new image, at the library's start: 1 with `follow` filled (descriptors made
 * close-on-exec) when a following exec started it, 0 when the environment said so but
 * could not be read, -1 when nothing followed (an injected copy waiting for its join).
 * Either way the environment no longer names the library or the descriptors.
 */
int hp_followed_start(struct hp_follow *follow);
