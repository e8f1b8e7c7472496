/* Makes kernel objects and frees every one of them again, then waits for RCU:
 *   release_all N SECONDS
 * registers N pipes with one epoll instance and removes them (epoll items are freed
 * with kfree_rcu on 6.x kernels), creates and unlinks N files in a tmpfs directory
 * (/dev/shm; their maple-tree nodes and inodes are freed after a grace period),
 * closes everything, then sleeps SECONDS so that RCU's deferred frees happen while the
 * profiler still watches. Prints "released" before the sleep. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: release_all N SECONDS\n");
        return 2;
    }
    int n = atoi(argv[1]);
    int seconds = atoi(argv[2]);
    int *fds = calloc((size_t)n * 2, sizeof(int));
    if (!fds) return 1;
    int ep = epoll_create1(0);
    if (ep < 0) return 1;
    for (int i = 0; i < n; i++) {
        if (pipe(&fds[2 * i]) != 0) return 1;
        struct epoll_event event = { .events = EPOLLIN, .data.u32 = (unsigned)i };
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fds[2 * i], &event) != 0) return 1;
    }
    for (int i = 0; i < n; i++) {
        if (epoll_ctl(ep, EPOLL_CTL_DEL, fds[2 * i], NULL) != 0) return 1;
        close(fds[2 * i]);
        close(fds[2 * i + 1]);
    }
    close(ep);
    char path[64];
    for (int i = 0; i < n; i++) {
        snprintf(path, sizeof path, "/dev/shm/heapprofd-release-%d-%d", (int)getpid(), i);
        int fd = open(path, O_CREAT | O_RDWR | O_EXCL, 0600);
        if (fd < 0) return 1;
        if (write(fd, "x", 1) != 1) return 1;
        close(fd);
        unlink(path);
    }
    free(fds);
    printf("released\n");
    fflush(stdout);
    sleep((unsigned)seconds);
    return 0;
}
