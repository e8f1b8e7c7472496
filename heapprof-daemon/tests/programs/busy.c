/* A process that is busy while heapprofd attaches: THREADS background threads
 * (up to 4, in functions busy_0 .. busy_3) allocate and free without pause, while the
 * main thread obeys commands read from stdin, one per line:
 *   work N SIZE        exact_work(N, SIZE), called from main; prints "done"
 *   deep N SIZE DEPTH  the same, called DEPTH frames deeper; prints "done"
 *   abandon            enters realloc() and never returns from it: glibc aborts on the
 *                      bogus pointer, and the SIGABRT handler longjmps out; prints
 *                      "abandoned" (the state a missed return leaves behind)
 * and exits at end of input. With "forever" as second argument it ignores stdin and
 * runs until killed.
 * exact_work(N, SIZE) allocates, per iteration: malloc(SIZE), calloc(2, SIZE),
 * realloc(NULL, SIZE) (glibc tail-calls malloc), then realloc of that block to 4*SIZE
 * (glibc calls malloc and free inside); it frees the malloc'd and realloc'd blocks and
 * keeps the calloc'd one. So 4N blocks / 8N*SIZE bytes allocated, N / 2N*SIZE in use.
 * Usage: busy THREADS [forever]. Prints "ready" once the threads run. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BUSY(n)                                                                     \
    __attribute__((noinline)) static void *busy_##n(void *arg) {                    \
        void *pool[64] = {0};                                                       \
        for (unsigned i = 0;; i++) {                                                \
            unsigned slot = (i * 7 + n) % 64;                                       \
            free(pool[slot]);                                                       \
            pool[slot] = (i & 3) ? malloc(16 + (i % 200)) : calloc(1, 32 + (i % 100)); \
            __asm__ volatile("" ::"r"(pool[slot]) : "memory");                      \
        }                                                                           \
        return arg;                                                                 \
    }
BUSY(0)
BUSY(1)
BUSY(2)
BUSY(3)
static void *(*const busy[4])(void *) = {busy_0, busy_1, busy_2, busy_3};

void *volatile kept;

__attribute__((noinline)) void exact_work(int n, int size) {
    for (int i = 0; i < n; i++) {
        void *a = malloc(size);
        void *b = calloc(2, size);
        void *c = realloc(NULL, size);
        c = realloc(c, 4 * size);
        free(a);
        free(c);
        kept = b;
    }
}

/* Recurses DEPTH frames (each with a buffer on the stack) before the work, so that the
 * allocator is entered below where an abandoned call entered it. */
__attribute__((noinline)) void deep_work(int depth, int n, int size) {
    volatile char frame[256];
    frame[0] = (char)depth;
    if (depth > 0)
        deep_work(depth - 1, n, size);
    else
        exact_work(n, size);
    __asm__ volatile("" ::"r"(frame) : "memory");
}

static sigjmp_buf escape;

static void on_abort(int sig) {
    (void)sig;
    siglongjmp(escape, 1);
}

__attribute__((noinline)) void abandon_a_call(void) {
    struct sigaction action, previous;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_abort;
    sigaction(SIGABRT, &action, &previous);
    if (sigsetjmp(escape, 1) == 0) {
        /* An aligned pointer into the middle of a string: no chunk header glibc accepts. */
        static char not_a_block[64] __attribute__((aligned(16)));
        kept = realloc(not_a_block + 16, 100);
    }
    sigaction(SIGABRT, &previous, NULL);
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    int forever = argc > 2 && strcmp(argv[2], "forever") == 0;
    char line[128];
    pthread_t tid;
    setvbuf(stdout, NULL, _IONBF, 0);
    if (threads > 4) threads = 4;
    for (int i = 0; i < threads; i++) pthread_create(&tid, NULL, busy[i], NULL);
    printf("ready\n");
    if (forever)
        for (;;) pause();
    while (fgets(line, sizeof line, stdin)) {
        int n, size, depth;
        if (sscanf(line, "work %d %d", &n, &size) == 2) {
            exact_work(n, size);
            printf("done\n");
        } else if (sscanf(line, "deep %d %d %d", &n, &size, &depth) == 3) {
            deep_work(depth, n, size);
            printf("done\n");
        } else if (strncmp(line, "abandon", 7) == 0) {
            abandon_a_call();
            printf("abandoned\n");
        } else {
            printf("unknown command\n");
        }
    }
    return 0;
}
