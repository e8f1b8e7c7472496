/* A traced process that forks and execs.
 * Usage: execer parent [PROGRAM] | execer image2
 * parent: prints "ready" and waits for a line; keeps 100 blocks of 64 bytes from
 *   parent_work(); forks a child that allocates 10 blocks in child_work() and exits;
 *   then execs PROGRAM (default: itself) with "image2".
 * image2: allocates 50 blocks of 32 bytes in image2_work() and frees 20; prints
 *   "done"; then answers each line "env" with what LD_PRELOAD and HEAPPROFD_FOLLOW
 *   hold ("-" for unset), until end of input. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

void *volatile keep[100];

__attribute__((noinline)) void parent_work(void) {
    for (int i = 0; i < 100; i++) keep[i] = malloc(64);
}

__attribute__((noinline)) void child_work(void) {
    for (int i = 0; i < 10; i++) keep[i] = malloc(16);
}

__attribute__((noinline)) void image2_work(void) {
    for (int i = 0; i < 50; i++) {
        void *p = malloc(32);
        if (i < 20) free(p); else keep[i] = p;
    }
}

int main(int argc, char **argv) {
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc > 1 && strcmp(argv[1], "image2") == 0) {
        image2_work();
        printf("done\n");
        while (fgets(line, sizeof line, stdin)) {
            if (strncmp(line, "env", 3) != 0)
                continue;
            const char *preload = getenv("LD_PRELOAD"), *follow = getenv("HEAPPROFD_FOLLOW");
            printf("LD_PRELOAD=%s HEAPPROFD_FOLLOW=%s\n", preload ? preload : "-",
                   follow ? follow : "-");
        }
        return 0;
    }
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    parent_work();
    pid_t child = fork();
    if (child == 0) {
        child_work();
        _exit(0);
    }
    waitpid(child, NULL, 0);
    const char *program = argc > 2 ? argv[2] : "/proc/self/exe";
    execl(program, program, "image2", (char *)NULL);
    perror("exec");
    return 1;
}
