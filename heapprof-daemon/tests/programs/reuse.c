/* An address one thread frees and another gets from the allocator at once: under the
 * preload library the first thread's free waits in its queue while the second thread's
 * allocation is counted. Run with GLIBC_TUNABLES=glibc.malloc.arena_max=1:
 * glibc.malloc.tcache_count=0, so both threads share one arena and no thread cache
 * keeps the block. Prints "reused=1" when the second block is at the first's address.
 * Expected profile: a_allocates 2000 bytes allocated, none in use; b_allocates 2000
 * bytes allocated and in use at exit. */
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>

static sem_t ready, freed, taken;
static void *a_block;
static int reused;

/* noipa: not folded into one function (they are identical); the empty asm after the
 * call keeps it from being a tail call, which would leave them out of the stack. */
__attribute__((noipa)) static void *a_allocates(void) {
    void *p = malloc(2000);
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}
__attribute__((noipa)) static void *b_allocates(void) {
    void *p = malloc(2000);
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}

static void *thread_a(void *unused) {
    (void)unused;
    void *p = a_allocates();
    a_block = p;
    free(p);
    sem_post(&freed);
    sem_wait(&taken); /* no allocation meanwhile: the free stays queued */
    return NULL;
}

static void *thread_b(void *unused) {
    (void)unused;
    free(malloc(1)); /* glibc allocates the thread's cache at its first malloc */
    sem_post(&ready);
    sem_wait(&freed);
    void *q = b_allocates();
    reused = q == a_block;
    __asm__ volatile("" : : "r"(q) : "memory"); /* kept: in use at exit */
    sem_post(&taken);
    return NULL;
}

int main(void) {
    sem_init(&ready, 0, 0);
    sem_init(&freed, 0, 0);
    sem_init(&taken, 0, 0);
    pthread_t a, b;
    if (pthread_create(&b, NULL, thread_b, NULL))
        return 1;
    sem_wait(&ready);
    if (pthread_create(&a, NULL, thread_a, NULL))
        return 1;
    pthread_join(b, NULL);
    pthread_join(a, NULL);
    printf("reused=%d\n", reused);
    return 0;
}
