/* Every function of the malloc family, a known number of times, in THREADS threads.
 * Usage: family THREADS ITERATIONS [PVALLOC=1] (valgrind 3.19 aborts on pvalloc: pass 0)
 * Per thread and iteration (see tests/exact.rs for the expected totals):
 *   allocations: malloc, calloc, realloc(NULL), realloc(grow), reallocarray(NULL),
 *                posix_memalign, aligned_alloc, memalign, valloc, pvalloc     = 10
 *   frees: realloc(grow) frees its old block, realloc(p, 0), free x 6         = 8
 *   kept until exit: the valloc and pvalloc blocks. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static int iterations, with_pvalloc;

__attribute__((noinline)) static void *exercise(void *unused) {
    (void)unused;
    for (int i = 0; i < iterations; i++) {
        void *p1 = malloc(16 + i);
        void *p2 = calloc(4, 8 + i);
        void *p3 = realloc(NULL, 32);
        p3 = realloc(p3, 64 + i);
        void *p4 = reallocarray(NULL, 3, 10);
        void *p5 = NULL;
        if (posix_memalign(&p5, 64, 100) != 0) abort();
        void *p6 = aligned_alloc(64, 128);
        void *p7 = memalign(32, 48);
        void *p8 = valloc(200);
        void *p9 = with_pvalloc ? pvalloc(100) : valloc(100);
        if (!p1 || !p2 || !p3 || !p4 || !p6 || !p7 || !p8 || !p9) abort();
        if (realloc(p4, 0) != NULL) abort(); /* glibc: frees p4 */
        free(NULL);
        free(p1); free(p2); free(p3); free(p5); free(p6); free(p7);
        __asm__ volatile("" : : "r"(p8), "r"(p9) : "memory"); /* kept: in use at exit */
    }
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    iterations = argc > 2 ? atoi(argv[2]) : 10;
    with_pvalloc = argc > 3 ? atoi(argv[3]) : 1;
    pthread_t tids[64];
    if (threads < 1 || threads > 64) return 2;
    for (int t = 0; t < threads; t++)
        if (pthread_create(&tids[t], NULL, exercise, NULL) != 0) return 3;
    for (int t = 0; t < threads; t++)
        pthread_join(tids[t], NULL);
    return 0;
}
