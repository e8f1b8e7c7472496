/* A known kernel-allocating workload: COUNT pipe2() calls, one byte written into each
 * (so each pipe gets a buffer page), all kept open, then all closed.
 * Driven by lines on stdin: prints "ready"; on a line opens the pipes and prints
 * "opened"; on the next line closes them and prints "closed"; exits at end of input. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <fcntl.h>

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 100;
    int *fds = calloc(2 * (size_t)count, sizeof *fds);
    char line[64];
    if (!fds) return 1;
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (int i = 0; i < count; i++) {
        if (pipe2(&fds[2 * i], O_CLOEXEC) != 0 || write(fds[2 * i + 1], "x", 1) != 1) {
            perror("pipe2");
            return 1;
        }
    }
    printf("opened\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    for (int i = 0; i < 2 * count; i++) close(fds[i]);
    printf("closed\n");
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
