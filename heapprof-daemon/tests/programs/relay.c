/* Allocations whose allocator function forwards to another probed one: glibc's
 * memalign and aligned_alloc with an alignment malloc gives anyway jump to malloc (a
 * tail call at the same stack pointer), and strdup calls malloc from the C library.
 * Usage: relay ITERATIONS. Per iteration: memalign(16, 200), aligned_alloc(16, 300),
 * calloc(10, 50), strdup of a 45-byte string, malloc(100); each freed at once. */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

__attribute__((noinline)) static void relay(int iterations) {
    for (int i = 0; i < iterations; i++) {
        void *volatile p = memalign(16, 200);
        free(p);
        p = aligned_alloc(16, 300);
        free(p);
        p = calloc(10, 50);
        free(p);
        p = strdup("a string of forty-four characters and a bit");
        free(p);
        p = malloc(100);
        free(p);
    }
}

int main(int argc, char **argv) {
    relay(argc > 1 ? atoi(argv[1]) : 1000);
    return 0;
}
