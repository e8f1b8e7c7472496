/* Short-lived forks that allocate at once and exit (tests/stacks.rs): a shell's fork
 * before its exec, a prefork server's worker at birth. Built without frame pointers,
 * so only CFI read with the right mappings takes their stacks back to main, and they
 * are gone before anyone could read their own mappings.
 *
 *   main calls child_main in CHILDREN forks, one after the other; each calls
 *   child_work (ALLOCS mallocs of 777 bytes), then forks a grandchild that calls
 *   grandchild_work (ALLOCS mallocs of 555 bytes). Every fork _exits at once.
 * Usage: forks CHILDREN ALLOCS */
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

void *volatile sink;

__attribute__((noinline, noclone)) static void child_work(int allocs) {
    for (int i = 0; i < allocs; i++) sink = malloc(777);
}

__attribute__((noinline, noclone)) static void grandchild_work(int allocs) {
    for (int i = 0; i < allocs; i++) sink = malloc(555);
}

__attribute__((noinline, noclone)) static void child_main(int allocs) {
    child_work(allocs);
    pid_t grandchild = fork();
    if (grandchild == 0) {
        grandchild_work(allocs);
        _exit(0);
    }
    if (grandchild > 0) waitpid(grandchild, NULL, 0);
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    int children = atoi(argv[1]), allocs = atoi(argv[2]);
    for (int c = 0; c < children; c++) {
        pid_t child = fork();
        if (child < 0) return 1;
        if (child == 0) {
            child_main(allocs);
            _exit(0);
        }
        int status = 0;
        if (waitpid(child, &status, 0) != child || status != 0) return 1;
    }
    return 0;
}
