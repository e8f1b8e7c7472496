/* Benchmark: the whole malloc family in THREADS threads, each keeping a pool of 64
 * live blocks that are replaced at random (so frees are not in allocation order).
 * Usage: bench_churn THREADS ITERATIONS [SECONDS]: ITERATIONS rounds per thread, or,
 * with SECONDS, as many rounds as fit. Waits for a line on stdin first. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define POOL 64
static long iterations;
static double seconds;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *allocate(unsigned r) {
    size_t size = 16 + (r >> 8) % 512;
    void *p = NULL;
    switch (r % 7) {
    case 0: return malloc(size);
    case 1: return calloc(2, size / 2 + 1);
    case 2: return realloc(malloc(size / 2 + 1), size);
    case 3: return reallocarray(NULL, 4, size / 4 + 1);
    case 4: return posix_memalign(&p, 64, size) == 0 ? p : NULL;
    case 5: return aligned_alloc(32, (size + 31) & ~(size_t)31);
    default: return memalign(16, size);
    }
}

static void *churn(void *arg) {
    unsigned seed = (unsigned)(long)arg * 2654435761u + 1;
    void *pool[POOL] = {0};
    double end = seconds > 0 ? now() + seconds : 0;
    for (long i = 0; seconds > 0 || i < iterations; i++) {
        if (seconds > 0 && (i & 1023) == 0 && now() > end) break;
        unsigned r = rand_r(&seed);
        unsigned slot = r % POOL;
        free(pool[slot]);
        pool[slot] = allocate(rand_r(&seed));
        if (!pool[slot]) abort();
    }
    for (int s = 0; s < POOL; s++) free(pool[s]);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    iterations = argc > 2 ? atol(argv[2]) : 20000;
    seconds = argc > 3 ? atof(argv[3]) : 0;
    char line[16];
    if (!fgets(line, sizeof line, stdin)) return 1;
    pthread_t ids[64];
    if (threads < 1 || threads > 64) return 2;
    for (long t = 0; t < threads; t++) pthread_create(&ids[t], NULL, churn, (void *)t);
    for (int t = 0; t < threads; t++) pthread_join(ids[t], NULL);
    return 0;
}
