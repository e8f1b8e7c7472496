/* Two allocator functions of the program's own whose probes share their page offset
 * (tests/sampling.rs): each begins a page, so the session program's table of probe
 * slots by page offset names neither, and the program takes the slot from the
 * kernel's attach cookie instead. Profiled with
 *   --allocator 'alloc=twin_alloc(size=arg1,ret) free=twin_free(ptr=arg1)'
 *
 * twin_alloc hands out blocks of a static arena (no other allocator is called);
 * twin_free takes nothing back but is counted as a free. Both begin with the same
 * push, so their probes sit at the same page offset. The program allocates
 * BLOCKS blocks of 64 to 288 bytes, frees every other one, and prints its counts with
 * write(2), in alloc_abc.c's format (the total only):
 *   pid=P allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
 *   done
 */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define BLOCKS 4000
#define ARENA_BYTES (BLOCKS * 288)

static _Alignas(64) char arena[ARENA_BYTES];
static size_t used;
void *volatile sink[BLOCKS];

static long calls;

/* Called first by both functions, which keep their argument across it in a register
 * they push: both begin with that push, where their probes go. */
__attribute__((noipa)) static void count_call(void) {
    calls++;
}

__attribute__((noipa, aligned(4096))) void *twin_alloc(size_t size) {
    count_call();
    if (used + size > sizeof arena)
        return NULL;
    void *block = arena + used;
    used += (size + 63) & ~(size_t)63;
    return block;
}

__attribute__((noipa, aligned(4096))) void twin_free(void *ptr) {
    count_call();
    sink[0] = ptr;
}

int main(void) {
    long allocated_objects = 0, allocated_bytes = 0, inuse_objects = 0, inuse_bytes = 0;
    for (int i = 0; i < BLOCKS; i++) {
        size_t size = 64 + (size_t)(i % 8) * 32;
        void *block = twin_alloc(size);
        if (block == NULL) {
            (void)!write(2, "arena full\n", 11);
            return 99;
        }
        allocated_objects++;
        allocated_bytes += (long)size;
        if (i % 2) {
            twin_free(block);
        } else {
            sink[i] = block;
            inuse_objects++;
            inuse_bytes += (long)size;
        }
    }
    char line[200];
    int n = snprintf(line, sizeof line,
                     "pid=%d allocated_objects=%ld allocated_bytes=%ld inuse_objects=%ld "
                     "inuse_bytes=%ld\ndone\n",
                     (int)getpid(), allocated_objects, allocated_bytes, inuse_objects,
                     inuse_bytes);
    (void)!write(1, line, (size_t)n);
    return 0;
}
