/* Benchmark: malloc/free pairs of mixed small sizes in one thread.
 * Usage: bench_pairs N. Waits for a line on stdin first, so a tracer can attach. */
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    long pairs = argc > 1 ? atol(argv[1]) : 200000;
    static const size_t sizes[] = {16, 24, 32, 48, 64, 96, 128, 256};
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (long i = 0; i < pairs; i++) {
        void *volatile block = malloc(sizes[i & 7]);
        free(block);
    }
    return 0;
}
