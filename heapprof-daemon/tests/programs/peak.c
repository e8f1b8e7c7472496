/* A known high-water mark of heap in use.
 *   peak serial:     burst() holds 64 x 4096 bytes at once, frees them, then keep()
 *                    holds 10 x 1000: the peak is exactly 262144 bytes, 10000 stay.
 *   peak threads N:  N threads each hold 16 x 4096 bytes until all of them hold theirs
 *                    (a barrier), then free them: the peak is at least N x 65536.
 * Nothing else allocates before the peak (no stdio until the end). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 4096
#define BURST 64
#define PER_THREAD 16

void *volatile sink[BURST];
static pthread_barrier_t all_hold;

__attribute__((noinline)) static void burst(void) {
    for (int i = 0; i < BURST; i++) sink[i] = malloc(BLOCK);
    for (int i = 0; i < BURST; i++) free(sink[i]);
}

__attribute__((noinline)) static void keep(void) {
    for (int i = 0; i < 10; i++) sink[i] = malloc(1000);
}

__attribute__((noinline)) static void *hold(void *unused) {
    void *volatile blocks[PER_THREAD];
    (void)unused;
    for (int i = 0; i < PER_THREAD; i++) blocks[i] = malloc(BLOCK);
    pthread_barrier_wait(&all_hold);
    for (int i = 0; i < PER_THREAD; i++) free(blocks[i]);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "serial") == 0) {
        burst();
        keep();
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "threads") == 0) {
        int n = atoi(argv[2]);
        pthread_t threads[64];
        if (n < 1 || n > 64) return 2;
        pthread_barrier_init(&all_hold, NULL, (unsigned)n);
        for (int i = 0; i < n; i++) pthread_create(&threads[i], NULL, hold, NULL);
        for (int i = 0; i < n; i++) pthread_join(threads[i], NULL);
        keep();
        return 0;
    }
    fprintf(stderr, "usage: peak serial | peak threads N\n");
    return 2;
}
