/* Load for heapprofd: many threads, many live blocks, endless churn.
 * Each mode prints "ready", waits for a line, works, prints what it allocated as
 * "expect ALLOC_OBJECTS ALLOC_BYTES INUSE_OBJECTS INUSE_BYTES" (its own count, to
 * compare with heapprofd's), then "done", and waits for end of input.
 *
 *   load threads THREADS COUNT  THREADS threads make COUNT allocations each in
 *                               thread_work(): every other one is freed at once, the
 *                               rest go through a ring of 1024 slots (so 1024 stay).
 *   load live COUNT             hold_live() keeps COUNT blocks of 32 bytes.
 *   load stacks COUNT           COUNT allocations through 64 distinct call stacks
 *                               (churn_leaf at depths 0..63), kept in the pool.
 *   load churn SECONDS          no "go", no report: for SECONDS, pairs of threads
 *                               (each pair lives half a second, so threads come and
 *                               go) replace blocks of a 4096-block pool through 64
 *                               distinct call stacks. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define RING 1024

static long count;
static long long inuse_bytes_of[64];
static void *volatile *held;

static size_t size_of(long i) { return 16 + (size_t)(i % 61) * 8; }

__attribute__((noinline)) static void *thread_work(void *arg) {
    long id = (long)arg;
    void **ring = calloc(RING, sizeof *ring); /* counted too: 1 block of 8 KiB */
    size_t sizes[RING] = {0};
    long long kept_bytes = 0;
    for (long i = 0; i < count; i++) {
        size_t size = size_of(i + id);
        void *p = malloc(size);
        if (!p) abort();
        if (i % 2 == 0) {
            free(p);
            continue;
        }
        long slot = (i / 2) % RING;
        if (ring[slot]) {
            free(ring[slot]);
            kept_bytes -= sizes[slot];
        }
        ring[slot] = p;
        sizes[slot] = size;
        kept_bytes += size;
    }
    inuse_bytes_of[id] = kept_bytes;
    return ring; /* kept, with its blocks, until exit */
}

__attribute__((noinline)) static void hold_live(long n) {
    held = malloc(n * sizeof *held);
    for (long i = 0; i < n; i++) held[i] = malloc(32);
}

/* Churn through distinct stacks: churn_level recurses to a depth in 0..63, then
 * churn_leaf replaces a block of the pool. */
static void *pool[4096];
static size_t pool_sizes[4096];
static long long pool_bytes, pool_blocks, allocated_bytes;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) static void churn_leaf(unsigned r) {
    size_t size = 16 + r % 1024;
    void *p = malloc(size);
    if (!p) abort();
    pthread_mutex_lock(&pool_lock);
    unsigned slot = (r >> 10) % 4096;
    if (pool[slot]) {
        free(pool[slot]);
        pool_bytes -= pool_sizes[slot];
        pool_blocks--;
    }
    pool[slot] = p;
    pool_sizes[slot] = size;
    pool_bytes += size;
    pool_blocks++;
    allocated_bytes += size;
    pthread_mutex_unlock(&pool_lock);
}

__attribute__((noinline)) static void churn_level(unsigned r, int depth) {
    if (depth == 0) {
        churn_leaf(r);
        return;
    }
    churn_level(r, depth - 1);
    __asm__ volatile("" ::: "memory"); /* not a tail call: each depth is a frame */
}

static double deadline, round_end;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *churn(void *arg) {
    unsigned seed = (unsigned)(long)arg + 1;
    for (long i = 0;; i++) {
        if ((i & 4095) == 0 && now() > round_end) break;
        unsigned r = rand_r(&seed);
        churn_level(r, (r >> 22) % 64);
    }
    return NULL;
}

int main(int argc, char **argv) {
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc < 3) {
        fprintf(stderr, "usage: load threads THREADS COUNT | live COUNT | churn SECONDS\n");
        return 2;
    }
    if (strcmp(argv[1], "churn") == 0) {
        deadline = now() + atof(argv[2]);
        for (long round = 0; now() < deadline; round++) {
            round_end = now() + 0.5;
            pthread_t threads[2];
            for (long t = 0; t < 2; t++)
                pthread_create(&threads[t], NULL, churn, (void *)(round * 2 + t));
            for (int t = 0; t < 2; t++) pthread_join(threads[t], NULL);
        }
        return 0;
    }
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    if (strcmp(argv[1], "threads") == 0 && argc > 3) {
        long threads = atol(argv[2]);
        count = atol(argv[3]);
        if (threads < 1 || threads > 64) return 2;
        pthread_t ids[64];
        for (long t = 0; t < threads; t++) pthread_create(&ids[t], NULL, thread_work, (void *)t);
        long long alloc_bytes = 0, inuse_bytes = 0;
        long long kept = count / 2 < RING ? count / 2 : RING;
        for (long t = 0; t < threads; t++) {
            pthread_join(ids[t], NULL);
            for (long i = 0; i < count; i++) alloc_bytes += size_of(i + t);
            inuse_bytes += inuse_bytes_of[t] + RING * sizeof(void *);
        }
        printf("expect %lld %lld %lld %lld\n", (long long)threads * (count + 1),
               alloc_bytes + threads * RING * (long long)sizeof(void *),
               threads * (kept + 1), inuse_bytes);
    } else if (strcmp(argv[1], "stacks") == 0) {
        long n = atol(argv[2]);
        for (long i = 0; i < n; i++) {
            unsigned r = (unsigned)i * 2654435761u;
            churn_level(r, (int)(i % 64));
        }
        printf("expect %ld %lld %lld %lld\n", n, allocated_bytes, pool_blocks, pool_bytes);
    } else if (strcmp(argv[1], "live") == 0) {
        long n = atol(argv[2]);
        hold_live(n);
        printf("expect %lld %lld %lld %lld\n", (long long)n + 1,
               (long long)n * 32 + n * (long long)sizeof(void *), (long long)n + 1,
               (long long)n * 32 + n * (long long)sizeof(void *));
    } else {
        return 2;
    }
    printf("done\n");
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
