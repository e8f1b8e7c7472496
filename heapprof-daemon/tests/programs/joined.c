/*
 * A process heapprofd joins while it runs (tests/inject.rs): it allocates through
 * every path a program has, one step per line read ("ready" first, "done" after each):
 *
 * - "work N": N rounds of allocations kept and freed, through the PLT (malloc,
 *   calloc, realloc, posix_memalign), inside the C library (strdup, fopen/fclose),
 *   and through libjoined_plugin.so, which it dlopens on its first "work";
 * - "saved N": N blocks allocated through the PLT and freed through a pointer to
 *   free taken at start-up, before any heapprofd joined (`saved_free`);
 * - "mixed N": N rounds of a block freed through that saved pointer, then one at the
 *   same address (the C library's cache hands it back) freed through the PLT;
 * - "descriptors N": puts a file of its own at descriptors 3 to 9, as a shell's
 *   `exec 6>&1` or a daemon's dup2 does, makes N allocations in `low_descriptors`,
 *   and says "done" only if the seven are still that file ("lost D" otherwise);
 * - "high-descriptors N": the same at descriptors 100 to 109, where the join keeps
 *   its own (a program that dup2s there takes them).
 *
 * Each round keeps one 40-byte malloc block ("kept"), so in-use is checkable.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void (*volatile saved_free)(void *);

__attribute__((noinline)) static void plt_paths(void **kept)
{
    void *volatile a = malloc(24);
    void *volatile b = calloc(3, 16);
    void *volatile c = realloc(NULL, 32);
    c = realloc(c, 128);
    void *d = NULL;
    if (posix_memalign(&d, 64, 96) != 0)
        abort();
    *kept = malloc(40);
    free(a);
    free(b);
    free(c);
    free(d);
}

__attribute__((noinline)) static void libc_paths(void)
{
    char *volatile s = strdup("a string duplicated inside the C library");
    free(s);
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f)
        abort();
    char line[64];
    if (!fgets(line, sizeof line, f))
        abort();
    fclose(f);
}

__attribute__((noinline)) static void saved_pointer(long n)
{
    for (long i = 0; i < n; i++) {
        void *volatile p = malloc(56);
        saved_free(p);
    }
}

__attribute__((noinline)) static void mixed_pointers(long n)
{
    for (long i = 0; i < n; i++) {
        void *volatile unseen = malloc(72);
        saved_free(unseen);
        void *volatile seen = malloc(72);
        free(seen);
    }
}

__attribute__((noinline)) static void low_descriptors(long n)
{
    for (long i = 0; i < n; i++) {
        void *volatile p = malloc(88);
        free(p);
    }
}

/* The "descriptors" commands: 0 if descriptors `first` to `last` stayed the file
 * placed there, else the first that did not. */
static int reuse_descriptors(long n, int first, int last)
{
    FILE *file = tmpfile();
    if (!file)
        abort();
    struct stat own;
    if (fstat(fileno(file), &own) != 0)
        abort();
    for (int fd = first; fd <= last; fd++)
        if (fd != fileno(file) && dup2(fileno(file), fd) != fd)
            abort();
    low_descriptors(n);
    for (int fd = first; fd <= last; fd++) {
        struct stat now;
        if (fstat(fd, &now) != 0 || now.st_ino != own.st_ino || now.st_dev != own.st_dev)
            return fd;
    }
    return 0;
}

int main(int argc, char **argv)
{
    saved_free = free;
    const char *plugin_path = argc > 1 ? argv[1] : NULL;
    void (*plugin_work)(void) = NULL;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[128];
    static void *kept[1 << 16];
    long kept_count = 0;
    while (fgets(line, sizeof line, stdin)) {
        long n = 0;
        if (sscanf(line, "work %ld", &n) == 1) {
            if (!plugin_work && plugin_path) {
                void *plugin = dlopen(plugin_path, RTLD_NOW);
                if (!plugin || !(plugin_work = (void (*)(void))dlsym(plugin, "plugin_work"))) {
                    printf("dlopen failed: %s\n", dlerror());
                    continue;
                }
            }
            for (long i = 0; i < n && kept_count < (1 << 16); i++) {
                plt_paths(&kept[kept_count++]);
                libc_paths();
                if (plugin_work)
                    plugin_work();
            }
            printf("done\n");
        } else if (sscanf(line, "saved %ld", &n) == 1) {
            saved_pointer(n);
            printf("done\n");
        } else if (sscanf(line, "mixed %ld", &n) == 1) {
            mixed_pointers(n);
            printf("done\n");
        } else if (sscanf(line, "descriptors %ld", &n) == 1 ||
                   sscanf(line, "high-descriptors %ld", &n) == 1) {
            int high = strncmp(line, "high-", 5) == 0;
            int lost = high ? reuse_descriptors(n, 100, 109) : reuse_descriptors(n, 3, 9);
            if (lost)
                printf("lost %d\n", lost);
            else
                printf("done\n");
        } else {
            printf("unknown command\n");
        }
    }
    return 0;
}
