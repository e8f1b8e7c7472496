/* Forks that allocate and exec at once (tests/modes.rs): a shell's or a build tool's
 * fork, whose queued records must be counted although its image is replaced right
 * after them.
 *
 *   main forks CHILDREN children, one after the other. Each calls before_exec (ALLOCS
 *   mallocs of 777 bytes, every second one freed at once), tries to exec a missing
 *   file (which fails and returns to this image), calls after_failed_exec (ALLOCS
 *   mallocs of 555 bytes, every second one freed) and execs /bin/true.
 * Usage: fork_exec CHILDREN ALLOCS */
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

void *volatile sink;

__attribute__((noinline, noclone)) static void before_exec(int allocs) {
    for (int i = 0; i < allocs; i++) {
        sink = malloc(777);
        if (i % 2) free(sink);
    }
}

__attribute__((noinline, noclone)) static void after_failed_exec(int allocs) {
    for (int i = 0; i < allocs; i++) {
        sink = malloc(555);
        if (i % 2) free(sink);
    }
}

int main(int argc, char **argv) {
    int children = argc > 1 ? atoi(argv[1]) : 100;
    int allocs = argc > 2 ? atoi(argv[2]) : 20;
    for (int c = 0; c < children; c++) {
        pid_t pid = fork();
        if (pid == 0) {
            char *args[] = {"true", NULL};
            before_exec(allocs);
            execv("/nonexistent/heapprofd-test", args);
            after_failed_exec(allocs);
            execv("/bin/true", args);
            _exit(127);
        }
        int status;
        if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            return 1;
    }
    return 0;
}
