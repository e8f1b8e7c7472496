/* Resizes that move a block the profiler holds. Built against jemalloc, whose realloc
 * moves a block to the slab of its new size class: each iteration allocates 1 MiB
 * (always sampled at a rate of 64 KiB), shrinks it to 16 bytes (a new address, and a
 * request so small it is rarely sampled), then frees the result. Nothing stays in
 * use. Usage: shrink ITERATIONS. */
#include <stdlib.h>
#include <string.h>

__attribute__((noinline)) static void shrink(int iterations) {
    for (int i = 0; i < iterations; i++) {
        char *volatile big = malloc(1 << 20);
        if (!big) abort();
        big[0] = 1;
        char *volatile small = realloc(big, 16);
        if (!small) abort();
        free(small);
    }
}

int main(int argc, char **argv) {
    shrink(argc > 1 ? atoi(argv[1]) : 100);
    return 0;
}
