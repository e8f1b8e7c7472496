/* Kernel objects freed on paths without a per-object tracepoint (tests/x86_vm.rs):
 *   deferred_frees N CHILDREN
 * - creates N timerfds and closes them: the kernel frees each one's context with
 *   kfree_rcu() (timerfd_release, on 5.10 to 6.12 alike), so through kvfree_call_rcu;
 * - forks CHILDREN processes that each map 256 single pages, alternately readable and
 *   writable so that no two merge, and exit: the maple tree of their VMAs (6.1+) is
 *   destroyed with kmem_cache_free_bulk (mt_free_bulk).
 * Prints "parent PID" first and "released" when done. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int map_pages(void) {
    long page = sysconf(_SC_PAGESIZE);
    for (int i = 0; i < 256; i++) {
        int prot = (i % 2) ? PROT_READ : PROT_READ | PROT_WRITE;
        if (mmap(NULL, (size_t)page, prot, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) == MAP_FAILED)
            return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: deferred_frees N CHILDREN\n");
        return 2;
    }
    int n = atoi(argv[1]);
    int children = atoi(argv[2]);
    printf("parent %d\n", (int)getpid());
    fflush(stdout);
    int *fds = calloc((size_t)n, sizeof(int));
    if (!fds) return 1;
    for (int i = 0; i < n; i++) {
        fds[i] = timerfd_create(CLOCK_MONOTONIC, 0);
        if (fds[i] < 0) return 1;
    }
    for (int i = 0; i < n; i++) close(fds[i]);
    free(fds);
    for (int i = 0; i < children; i++) {
        pid_t child = fork();
        if (child < 0) return 1;
        if (child == 0) _exit(map_pages());
        int status;
        if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
            return 1;
    }
    printf("released\n");
    fflush(stdout);
    return 0;
}
