/* A script's child that allocates only when told to (tests/modes.rs): launch mode
 * probes a child its library cannot serve once it has read the child's new program,
 * so the test releases it after that.
 *
 *   Writes its pid to PIDFILE, waits until GOFILE exists, then calls child_work:
 *   COUNT mallocs of 48 bytes, of which the first third are freed. Prints "done".
 * Usage: late_child PIDFILE GOFILE COUNT */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

void *volatile sink;

__attribute__((noinline, noclone)) static void child_work(int count) {
    void **blocks = calloc((size_t)count, sizeof *blocks);
    for (int i = 0; i < count; i++) blocks[i] = malloc(48);
    for (int i = 0; i < count / 3; i++) free(blocks[i]);
    /* The rest stay in use; the array is freed, so it counts as a temporary. */
    sink = blocks[count - 1];
    free(blocks);
}

int main(int argc, char **argv) {
    if (argc != 4) return 2;
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
    FILE *pid = fopen(tmp, "w");
    if (!pid) return 1;
    fprintf(pid, "%d\n", (int)getpid());
    if (fclose(pid) != 0 || rename(tmp, argv[1]) != 0) return 1;
    for (int waited = 0; access(argv[2], F_OK) != 0; waited++) {
        if (waited > 60000) return 3;
        usleep(1000);
    }
    child_work(atoi(argv[3]));
    puts("done");
    return 0;
}
