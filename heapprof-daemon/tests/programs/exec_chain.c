/* A process that execs itself through each exec function in turn, for the joined
 * process's exec-following test.
 * Usage: exec_chain K (K from 7 down to 0; run with 7)
 * Image 7 prints "ready", the others "exec'd K"; each waits for a line, keeps 10 blocks of 16*(K+1) bytes from
 * image_work(), prints "image K LD_PRELOAD=... HEAPPROFD_FOLLOW=..." ("-" for unset),
 * waits for a line and execs image K-1 through function K of the list below (image 0
 * waits for end of input). Image 7 first tries an exec of a missing file and prints
 * "missing ERRNO DESCRIPTORS-BEFORE DESCRIPTORS-AFTER". */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern char **environ;

void *volatile keep[10];

__attribute__((noinline)) void image_work(int k) {
    for (int i = 0; i < 10; i++) keep[i] = malloc(16 * (k + 1));
}

static int descriptors(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    while (d && readdir(d)) n++;
    if (d) closedir(d);
    return n;
}

int main(int argc, char **argv) {
    char line[64], next[8], self[4096];
    setvbuf(stdout, NULL, _IONBF, 0);
    /* Unbuffered: a line read ahead would be lost with the image at the exec. */
    setvbuf(stdin, NULL, _IONBF, 0);
    int k = argc > 1 ? atoi(argv[1]) : 7;
    if (k == 7)
        printf("ready\n");
    else
        printf("exec'd %d\n", k);
    if (!fgets(line, sizeof line, stdin)) return 1;
    image_work(k);
    const char *preload = getenv("LD_PRELOAD"), *follow = getenv("HEAPPROFD_FOLLOW");
    printf("image %d LD_PRELOAD=%s HEAPPROFD_FOLLOW=%s\n", k, preload ? preload : "-",
           follow ? follow : "-");
    if (k == 7) {
        int before = descriptors();
        char *const missing[] = { "missing", NULL };
        int result = execvp("/nonexistent/heapprofd-test", missing);
        int error = errno;
        printf("missing %d %s %d %d\n", result, strerror(error), before, descriptors());
    }
    if (k == 0) {
        while (fgets(line, sizeof line, stdin)) {}
        return 0;
    }
    if (!fgets(line, sizeof line, stdin)) return 1;
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0) return 1;
    self[n] = 0;
    snprintf(next, sizeof next, "%d", k - 1);
    char *const args[] = { argv[0], next, NULL };
    char *const *env = environ;
    /* The p-variants search PATH for a name with a slash: the path itself. */
    switch (k) {
    case 7: execl(self, argv[0], next, (char *)NULL); break;
    case 6: execle(self, argv[0], next, (char *)NULL, env); break;
    case 5: execlp(self, argv[0], next, (char *)NULL); break;
    case 4: execv(self, args); break;
    case 3: execvp(self, args); break;
    case 2: execvpe(self, args, env); break;
    case 1: execve(self, args, env); break;
    }
    perror("exec");
    return 1;
}
