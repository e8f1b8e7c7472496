/* Signal handlers that allocate and free while the thread they interrupt frees: under
 * the preload library, a handler can interrupt the library while it appends a free to
 * the thread's queue or reports the queue, and its own calls must still be counted.
 *
 * The main thread allocates 1000 blocks of 1000 bytes, then frees them one by one,
 * ROUNDS times; a second thread sends it SIGUSR1 meanwhile, the next as soon as the
 * last was handled (without that wait the main thread would only ever run its
 * handler). The handler allocates 24
 * bytes and frees them (glibc serves that size from the thread's cache, which the
 * main thread's 1000-byte calls never touch, and the block always goes back there:
 * no lock is taken in the handler). Prints the handler's calls: "handled=N".
 * Expected profile: main_allocates 1000 x ROUNDS blocks, handler_allocates N + 1
 * blocks of 24 bytes, all freed. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>

static volatile sig_atomic_t handled, done;
static pthread_t main_thread;

__attribute__((noipa)) static void *handler_allocates(void) {
    void *p = malloc(24);
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}

__attribute__((noipa)) static void *main_allocates(void) {
    void *p = malloc(1000);
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}

static void on_signal(int signal) {
    (void)signal;
    free(handler_allocates());
    handled++;
}

static void *signaller(void *unused) {
    (void)unused;
    while (!done) {
        sig_atomic_t seen = handled;
        pthread_kill(main_thread, SIGUSR1);
        while (handled == seen && !done)
            ;
    }
    return NULL;
}

#define BLOCKS 1000

int main(int argc, char **argv) {
    long rounds = argc > 1 ? atol(argv[1]) : 200;
    static void *held[BLOCKS];
    /* The handler's size class is in the thread's cache before the first signal. */
    free(handler_allocates());
    struct sigaction action = { .sa_handler = on_signal };
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &action, NULL);
    main_thread = pthread_self();
    pthread_t sender;
    if (pthread_create(&sender, NULL, signaller, NULL))
        return 1;
    for (long round = 0; round < rounds; round++) {
        for (long i = 0; i < BLOCKS; i++)
            held[i] = main_allocates();
        for (long i = 0; i < BLOCKS; i++)
            free(held[i]);
    }
    done = 1;
    pthread_join(sender, NULL);
    /* Signals still pending are handled before this line: none may come after it. */
    signal(SIGUSR1, SIG_IGN);
    printf("handled=%d\n", (int)handled);
    return 0;
}
