/* Two processes taking turns on one CPU (tests/sampling.rs): the parent pins itself to
 * its first allowed CPU, forks, and parent and child pass a token through two pipes,
 * each allocating a round of blocks in allocate_round() while it holds the token.
 * Every pass of the token switches the CPU from one process to the other, so a probe
 * program that kept a thread's id across a context switch would count one process's
 * blocks under the other.
 *
 * Each process prints its own counts with write(2), in alloc_abc.c's format, the
 * child first:
 *   pid=P allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
 * and the parent ends with `done`.
 */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROUNDS 200
#define BLOCKS 20

static long allocated_objects, allocated_bytes, inuse_objects, inuse_bytes;
void *volatile sink[ROUNDS * BLOCKS];
static int sunk;

static void fail(const char *what) {
    (void)!write(2, what, strlen(what));
    _exit(99);
}

/* One round: BLOCKS blocks of 96 to 168 bytes (the child's 8 more), every other one
 * freed at once. */
__attribute__((noipa)) static void allocate_round(int offset) {
    for (int i = 0; i < BLOCKS; i++) {
        size_t size = 96 + (size_t)((i + offset) % 5) * 16 + (size_t)offset * 8;
        void *block = malloc(size);
        if (block == NULL)
            fail("malloc failed\n");
        allocated_objects++;
        allocated_bytes += (long)size;
        if (i % 2) {
            free(block);
        } else {
            sink[sunk++] = block;
            inuse_objects++;
            inuse_bytes += (long)size;
        }
    }
}

static void take_turns(int from, int to, int offset) {
    char token;
    for (int round = 0; round < ROUNDS; round++) {
        if (read(from, &token, 1) != 1)
            fail("token lost\n");
        allocate_round(offset);
        if (write(to, &token, 1) != 1)
            fail("token not passed\n");
    }
}

static void print_counts(void) {
    char line[200];
    int n = snprintf(line, sizeof line,
                     "pid=%d allocated_objects=%ld allocated_bytes=%ld inuse_objects=%ld "
                     "inuse_bytes=%ld\n",
                     (int)getpid(), allocated_objects, allocated_bytes, inuse_objects,
                     inuse_bytes);
    (void)!write(1, line, (size_t)n);
}

int main(void) {
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof allowed, &allowed) != 0)
        fail("sched_getaffinity failed\n");
    int cpu = 0;
    while (cpu < CPU_SETSIZE && !CPU_ISSET(cpu, &allowed))
        cpu++;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    if (sched_setaffinity(0, sizeof one, &one) != 0)
        fail("sched_setaffinity failed\n");
    int to_child[2], to_parent[2];
    if (pipe(to_child) != 0 || pipe(to_parent) != 0)
        fail("pipe failed\n");
    pid_t child = fork();
    if (child < 0)
        fail("fork failed\n");
    if (child == 0) {
        take_turns(to_child[0], to_parent[1], 1);
        print_counts();
        _exit(0);
    }
    char token = 't';
    if (write(to_child[1], &token, 1) != 1)
        fail("first token not passed\n");
    take_turns(to_parent[0], to_child[1], 0);
    int status;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("the child failed\n");
    print_counts();
    (void)!write(1, "done\n", 5);
    return 0;
}
