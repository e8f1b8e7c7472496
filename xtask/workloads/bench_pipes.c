/* The kernel section's workload: N cycles of pipe2() and two close()s, about 9 slab
 * allocations and frees each (a file, a dentry, an inode, the pipe's buffers, ...).
 * Prints the loop's own time ("loop SECONDS"), so that a tool's start-up and exit are
 * not part of the figure. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    long cycles = argc > 1 ? atol(argv[1]) : 300000;
    int fds[2];
    struct timespec start, end;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (long i = 0; i < cycles; i++) {
        if (pipe2(fds, O_CLOEXEC) != 0) {
            perror("pipe2");
            return 1;
        }
        close(fds[0]);
        close(fds[1]);
    }
    clock_gettime(CLOCK_MONOTONIC, &end);
    printf("loop %.4f\n",
           (double)(end.tv_sec - start.tv_sec) + (double)(end.tv_nsec - start.tv_nsec) / 1e9);
    return 0;
}
