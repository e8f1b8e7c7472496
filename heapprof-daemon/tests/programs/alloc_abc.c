/* main/a/b through an allocator's whole C API (tests/allocators.rs): the same
 * program runs on glibc, jemalloc, tcmalloc, mimalloc (preloaded or linked), musl
 * (dynamic and static) and static glibc, and counts what it allocates itself.
 *
 *   main -> a -> b, main -> a, main -> b; `a` is called ROUNDS times, `b` from main
 *   once. Each site has its own size. The calls: malloc, calloc, realloc (of NULL, to
 *   grow, to shrink), posix_memalign, aligned_alloc, free; some blocks are freed and
 *   some kept (in a volatile sink), so in-use and allocated figures differ.
 *
 * Counting follows heapprofd's rules: realloc(p, n) frees p and allocates n bytes,
 * realloc(NULL, n) allocates n, calloc(n, s) allocates n*s bytes.
 *
 * Output, with write(2) only (stdio would malloc its buffer through the allocator
 * under test), after the work:
 *   pid=P allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
 *   stack=a<-main allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
 *   stack=b<-a<-main ...
 *   stack=b<-main ...
 *   done
 * With the argument `wait`, it first prints "ready", waits for a line on stdin, does
 * the work, prints its counts, then waits for the end of stdin before exiting (so an
 * --all session can take its final profile while the blocks are still live).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__clang__)
#define NOINLINE __attribute__((noinline))
#else
/* noipa: neither inlined nor cloned (no b.constprop.0), so the frames are `a`, `b`. */
#define NOINLINE __attribute__((noipa))
#endif

#define ROUNDS 3

enum site { SITE_A, SITE_B_FROM_A, SITE_B_FROM_MAIN, SITES };
static const char *const site_names[SITES] = {"a<-main", "b<-a<-main", "b<-main"};

struct counts {
    long allocated_objects, allocated_bytes, inuse_objects, inuse_bytes;
};
static struct counts per_site[SITES];

/* The live blocks this program allocated: their site and size. */
static struct {
    void *ptr;
    int site;
    long size;
} live[256];

void *volatile sink[256];
static int sunk;

static void fail(const char *what) {
    (void)!write(2, what, strlen(what));
    _exit(99);
}

static void note_alloc(void *ptr, enum site site, long size) {
    if (ptr == NULL)
        fail("allocation failed\n");
    for (int i = 0; i < 256; i++) {
        if (live[i].ptr == NULL) {
            live[i].ptr = ptr;
            live[i].site = site;
            live[i].size = size;
            per_site[site].allocated_objects++;
            per_site[site].allocated_bytes += size;
            per_site[site].inuse_objects++;
            per_site[site].inuse_bytes += size;
            return;
        }
    }
    fail("live table full\n");
}

static void note_free(void *ptr) {
    for (int i = 0; i < 256; i++) {
        if (live[i].ptr == ptr) {
            per_site[live[i].site].inuse_objects--;
            per_site[live[i].site].inuse_bytes -= live[i].size;
            live[i].ptr = NULL;
            return;
        }
    }
    fail("freeing an unknown block\n");
}

static void keep(void *ptr) {
    if (sunk == 256)
        fail("sink full\n");
    sink[sunk++] = ptr;
}

/* b: malloc 100 (kept), aligned_alloc 128x384 (freed), calloc 3x40 (kept),
 * malloc 50 grown by realloc to 70 (kept). From main every size is +8. */
NOINLINE void b(enum site site) {
    long extra = site == SITE_B_FROM_MAIN ? 8 : 0;
    void *p = malloc(100 + extra);
    note_alloc(p, site, 100 + extra);
    keep(p);

    void *q = aligned_alloc(128, 384 + 128 * extra / 8);
    note_alloc(q, site, 384 + 128 * extra / 8);

    void *r = calloc(3, 40 + extra);
    note_alloc(r, site, 3 * (40 + extra));
    keep(r);

    void *s = malloc(50 + extra);
    note_alloc(s, site, 50 + extra);
    void *t = realloc(s, 70 + extra);
    note_free(s);
    note_alloc(t, site, 70 + extra);
    keep(t);

    free(q);
    note_free(q);
}

/* a: malloc 1000 (kept), calloc 10x24 (freed), realloc(NULL, 300) grown to 5000
 * then shrunk to 4000 (kept), posix_memalign 64x200 (kept), b, then free. */
NOINLINE void a(void) {
    void *p = malloc(1000);
    note_alloc(p, SITE_A, 1000);
    keep(p);

    void *q = calloc(10, 24);
    note_alloc(q, SITE_A, 240);

    void *r = realloc(NULL, 300);
    note_alloc(r, SITE_A, 300);
    void *r2 = realloc(r, 5000);
    note_free(r);
    note_alloc(r2, SITE_A, 5000);
    void *r3 = realloc(r2, 4000);
    note_free(r2);
    note_alloc(r3, SITE_A, 4000);
    keep(r3);

    void *m = NULL;
    if (posix_memalign(&m, 64, 200) != 0)
        fail("posix_memalign failed\n");
    note_alloc(m, SITE_A, 200);
    keep(m);

    b(SITE_B_FROM_A);

    free(q);
    note_free(q);
}

/* Output without stdio. */
static char out[4096];
static size_t used;

static void put(const char *s) {
    size_t n = strlen(s);
    if (used + n > sizeof out)
        fail("output buffer full\n");
    memcpy(out + used, s, n);
    used += n;
}

static void put_number(const char *key, long value) {
    char digits[32];
    int n = 0;
    unsigned long v = value < 0 ? -(unsigned long)value : (unsigned long)value;
    do {
        digits[n++] = '0' + v % 10;
        v /= 10;
    } while (v);
    char text[40];
    int i = 0;
    if (value < 0)
        text[i++] = '-';
    while (n)
        text[i++] = digits[--n];
    text[i] = 0;
    put(key);
    put("=");
    put(text);
}

static void put_counts(const struct counts *c) {
    put_number(" allocated_objects", c->allocated_objects);
    put_number(" allocated_bytes", c->allocated_bytes);
    put_number(" inuse_objects", c->inuse_objects);
    put_number(" inuse_bytes", c->inuse_bytes);
    put("\n");
}

static void flush(void) {
    size_t done = 0;
    while (done < used) {
        ssize_t n = write(1, out + done, used - done);
        if (n <= 0)
            _exit(98);
        done += n;
    }
    used = 0;
}

/* Reads stdin up to a newline (returns 1) or its end (returns 0). */
static int read_line(void) {
    char c;
    for (;;) {
        ssize_t n = read(0, &c, 1);
        if (n <= 0)
            return 0;
        if (c == '\n')
            return 1;
    }
}

int main(int argc, char **argv) {
    int wait = argc > 1 && strcmp(argv[1], "wait") == 0;
    if (wait) {
        put("ready\n");
        flush();
        if (!read_line())
            return 3;
    }

    for (int i = 0; i < ROUNDS; i++)
        a();
    b(SITE_B_FROM_MAIN);

    struct counts total = {0, 0, 0, 0};
    for (int s = 0; s < SITES; s++) {
        total.allocated_objects += per_site[s].allocated_objects;
        total.allocated_bytes += per_site[s].allocated_bytes;
        total.inuse_objects += per_site[s].inuse_objects;
        total.inuse_bytes += per_site[s].inuse_bytes;
    }
    put_number("pid", (long)getpid());
    put_counts(&total);
    for (int s = 0; s < SITES; s++) {
        put("stack=");
        put(site_names[s]);
        put_counts(&per_site[s]);
    }
    put("done\n");
    flush();

    if (wait)
        while (read_line())
            ;
    return sink[0] == NULL;
}
