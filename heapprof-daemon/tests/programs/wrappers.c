/* Allocations made inside the C library's own functions, for the true-stacks tests
 * (tests/true_stacks.rs): strdup, getline, fopen (and the stdio buffers fprintf and
 * the first read allocate), asprintf, plus direct mallocs and a calloc, over three
 * levels of the program's own functions. Built with
 * `gcc -O2 -g -fomit-frame-pointer`, so neither the program nor libc keeps a frame
 * chain: the callers of these wrappers come back only from unwinding with CFI.
 *
 * Call levels: main -> run -> write_input / read_lines / format_lines ->
 * remember_line / tag_line. Deterministic; no input. It writes two files in the
 * directory given as its only argument (default: the current directory).
 *
 * Every realloc here (getline growing its buffer in getdelim, asprintf shrinking its
 * result in __vasprintf_internal) happens in the function that malloc'd the block,
 * under the same callers: valgrind's DHAT charges a realloc to the block's original
 * allocation site, heapprofd to the realloc's own stack, and the two agree only then
 * (see tests/common/dhat.rs). open_memstream, whose buffer fprintf allocates and
 * fclose reallocs, would break that, so it is not used. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define LINES 300

struct entry {
    char *text; /* strdup */
    char *tag;  /* asprintf */
    size_t length;
};

static struct entry entries[LINES];
static size_t entry_count;
static char path[4096], report_path[4096];

/* fopen allocates the FILE and, at the first write, its buffer; both are freed by fclose. */
__attribute__((noinline)) static void write_input(void) {
    FILE *out = fopen(path, "w");
    if (!out) { perror(path); exit(3); }
    /* Lines of 32 to 230 bytes: getline's first buffer (120 bytes) must grow. */
    for (int i = 0; i < LINES; i++) {
        fprintf(out, "line %03d of the input: ", i);
        for (int k = 0; k < 10 + (i * 37) % 200; k++) fputc('a' + k % 26, out);
        fputc('\n', out);
    }
    if (fclose(out) != 0) { perror(path); exit(3); }
}

__attribute__((noinline)) static void remember_line(const char *line, size_t length) {
    struct entry *e = &entries[entry_count++];
    e->text = strdup(line);
    e->length = length;
    if (!e->text) exit(4);
}

/* getline allocates the line buffer and grows it (realloc) for longer lines; the read
 * buffer of a FILE opened for reading is allocated by the first read. */
__attribute__((noinline)) static void read_lines(void) {
    FILE *in = fopen(path, "r");
    if (!in) { perror(path); exit(3); }
    char *line = NULL;
    size_t capacity = 0;
    ssize_t length;
    while ((length = getline(&line, &capacity, in)) > 0 && entry_count < LINES)
        remember_line(line, (size_t)length);
    free(line);
    fclose(in);
}

__attribute__((noinline)) static void tag_line(struct entry *e, int i) {
    if (asprintf(&e->tag, "entry %d has %zu bytes and starts with %.12s", i, e->length, e->text) < 0)
        exit(5);
}

__attribute__((noinline)) static size_t format_lines(void) {
    FILE *report = fopen(report_path, "w");
    if (!report) { perror(report_path); exit(6); }
    size_t total = 0;
    for (size_t i = 0; i < entry_count; i++) {
        tag_line(&entries[i], (int)i);
        int written = fprintf(report, "%s\n", entries[i].tag);
        if (written < 0) exit(6);
        total += (size_t)written;
    }
    if (fclose(report) != 0) { perror(report_path); exit(6); }
    return total;
}

__attribute__((noinline)) static size_t run(void) {
    write_input();
    read_lines();
    size_t total = format_lines();
    /* Direct mallocs of several sizes, some kept until exit. */
    size_t *lengths = malloc(entry_count * sizeof *lengths);
    if (!lengths) exit(7);
    for (size_t i = 0; i < entry_count; i++) {
        lengths[i] = entries[i].length;
        total += lengths[i];
        if (i % 3 == 0) {
            free(entries[i].text);
            entries[i].text = NULL;
        }
    }
    char *scratch = calloc(64, 32);
    if (!scratch) exit(7);
    memcpy(scratch, path, 16);
    total += (size_t)scratch[0];
    free(scratch);
    free(lengths);
    return total;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : ".";
    if (snprintf(path, sizeof path, "%s/wrappers-input.txt", dir) >= (int)sizeof path ||
        snprintf(report_path, sizeof report_path, "%s/wrappers-report.txt", dir) >= (int)sizeof report_path)
        return 2;
    size_t total = run();
    printf("%zu\n", total);
    return remove(path) != 0 || remove(report_path) != 0;
}
