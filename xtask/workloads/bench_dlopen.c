/* Benchmark: loads shared libraries, for timing heapprofd's unwind-table build of one
 * big library (launch mode; the loader's hook tells heapprofd of each new object).
 * Usage: bench_dlopen LIB...: dlopen()s each LIB in order, then exits.
 *        bench_dlopen --new-objects LIB: dlopen()s LIB, then prints the objects that came
 *        with it (its dependencies that were not loaded yet), one path a line, LIB excluded. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

#define MAX_OBJECTS 1024
static const char *before[MAX_OBJECTS];
static int before_count;
static const char *skip;

static int remember(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    (void)data;
    if (before_count < MAX_OBJECTS) before[before_count++] = strdup(info->dlpi_name);
    return 0;
}

static int print_new(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    (void)data;
    const char *name = info->dlpi_name;
    if (name[0] != '/' || strcmp(name, skip) == 0) return 0;
    for (int i = 0; i < before_count; i++)
        if (strcmp(before[i], name) == 0) return 0;
    printf("%s\n", name);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--new-objects") == 0) {
        dl_iterate_phdr(remember, NULL);
        skip = argv[2];
        if (!dlopen(argv[2], RTLD_LAZY | RTLD_LOCAL)) {
            fprintf(stderr, "bench_dlopen: %s\n", dlerror());
            return 1;
        }
        dl_iterate_phdr(print_new, NULL);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        if (!dlopen(argv[i], RTLD_LAZY | RTLD_LOCAL)) {
            fprintf(stderr, "bench_dlopen: %s\n", dlerror());
            return 1;
        }
    }
    return 0;
}
