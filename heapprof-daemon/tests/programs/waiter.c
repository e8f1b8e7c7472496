/* Waits for a line on stdin, then makes COUNT allocations of SIZE bytes in work()
 * and frees every other one; then waits for end of input and exits.
 * Usage: waiter COUNT SIZE. Prints "ready" once it waits. */
#include <stdio.h>
#include <stdlib.h>

void *volatile keep;

__attribute__((noinline)) void work(int count, int size) {
    for (int i = 0; i < count; i++) {
        void *p = malloc(size);
        if (i % 2 == 0) free(p); else keep = p;
    }
}

int main(int argc, char **argv) {
    int count = argc > 1 ? atoi(argv[1]) : 10, size = argc > 2 ? atoi(argv[2]) : 64;
    char line[64];
    setvbuf(stdout, NULL, _IONBF, 0);
    printf("ready\n");
    if (!fgets(line, sizeof line, stdin)) return 1;
    work(count, size);
    printf("done\n");
    while (fgets(line, sizeof line, stdin)) {}
    return 0;
}
