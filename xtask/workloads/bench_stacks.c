/* Benchmark: N allocations from N distinct call stacks, all kept, for timing profile
 * dumps. Paths through two mutually recursive functions spell out the bits of each
 * index, so every index has its own stack. Build with frame pointers and no sibling
 * calls. Usage: bench_stacks N. Waits for a line on stdin before allocating and
 * for end of input before exiting. */
#include <stdio.h>
#include <stdlib.h>

static void *volatile kept[1 << 20]; /* volatile: the blocks must really be allocated */
static long count;

__attribute__((noinline)) static void left(unsigned path, int depth);
__attribute__((noinline)) static void right(unsigned path, int depth);

__attribute__((noinline)) static void leaf(unsigned path) {
    kept[count++] = malloc(16 + path % 64);
    __asm__ volatile("" ::: "memory");
}

__attribute__((noinline)) static void left(unsigned path, int depth) {
    if (depth == 0) leaf(path);
    else if (path & 1) left(path >> 1, depth - 1);
    else right(path >> 1, depth - 1);
    __asm__ volatile("" ::: "memory");
}

__attribute__((noinline)) static void right(unsigned path, int depth) {
    if (depth == 0) leaf(path);
    else if (path & 1) left(path >> 1, depth - 1);
    else right(path >> 1, depth - 1);
    __asm__ volatile("" ::: "memory");
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10000;
    if (n < 1 || n > (1 << 20)) return 2;
    int depth = 0;
    while ((1L << depth) < n) depth++;
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (long i = 0; i < n; i++) left((unsigned)i, depth);
    printf("allocated\n");
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
