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
 * no lock is taken in the handler). The rounds go on past ROUNDS until MIN_HANDLED
 * signals were handled (a loaded machine delivers fewer per round), up to 50 x ROUNDS.
 * Prints the rounds and the handler's calls: "rounds=R handled=N".
 * Expected profile: main_allocates 1000 x R blocks, handler_allocates N + 1
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
    long min_handled = argc > 2 ? atol(argv[2]) : 0;
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
    long round = 0;
    for (; round < rounds || (handled < min_handled && round < 50 * rounds); round++) {
        for (long i = 0; i < BLOCKS; i++)
            held[i] = main_allocates();
        for (long i = 0; i < BLOCKS; i++)
            free(held[i]);
    }
    done = 1;
    pthread_join(sender, NULL);
    /* Signals still pending are handled before this line: none may come after it. */
    signal(SIGUSR1, SIG_IGN);
    printf("rounds=%ld handled=%d\n", round, (int)handled);
    return 0;
}
