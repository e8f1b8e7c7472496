/* A program with its own pool allocator, profiled through `heapprofd --allocator`
 * (tests/allocators.rs). The pool carves small blocks out of chunks it mallocs and
 * keeps a free list per size class; large blocks are malloc'd one by one. Its API:
 *
 *   struct pool *pool_create(size_t chunk_size);
 *   void *pool_alloc(struct pool *, size_t size);               alloc: size=arg2, ret
 *   void *pool_calloc(struct pool *, size_t count, size_t size); alloc: count=arg2, size=arg3, ret
 *   void *pool_realloc(struct pool *, void *old, size_t size);  realloc: ptr=arg2, size=arg3, ret
 *   void pool_free(struct pool *, void *ptr);                   free: ptr=arg2
 *   void *node_new(struct pool *);    a fixed-size 48-byte node: alloc: size=48, ret
 *   void node_delete(struct pool *, void *node);                free: ptr=arg2
 *   void pool_destroy(struct pool *);
 *
 * Inside these, the pool calls malloc (a new chunk, a large block) and free, and
 * pool_realloc, pool_calloc, node_new and node_delete call pool_alloc/pool_free:
 * heapprofd counts each call the program made once, as that call.
 *
 * main -> a -> b, main -> a, main -> b, each site with its own sizes; some blocks are
 * given back. The pool counts what the program asked of it (pool_realloc(p, n) is a
 * free of p and an allocation of n bytes, pool_calloc(n, s) n*s bytes), per stack,
 * and prints the counts with write(2) (no stdio: it would malloc), in the format of
 * alloc_abc.c:
 *   pid=P allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
 *   stack=a<-main ...
 *   stack=b<-a<-main ...
 *   stack=b<-main ...
 *   chunks=N large=N
 *   done
 * A second, short-lived pool in main (its own site, `scratch_work`) is emptied and
 * destroyed before the counts are printed; its allocations are counted under the
 * stack scratch_work<-main.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__clang__)
#define NOINLINE __attribute__((noinline))
#else
#define NOINLINE __attribute__((noipa))
#endif

/* ---------------------------------------------------------------- the pool */

#define CLASS_SIZE 16
#define CLASSES 16 /* blocks up to 256 bytes come from chunks */
#define LARGE_CLASS CLASSES

struct header {
    size_t size;  /* what was asked for */
    size_t class; /* size class, or LARGE_CLASS */
};

struct free_block {
    struct free_block *next;
};

struct chunk {
    struct chunk *next;
    size_t used;
    size_t capacity;
    _Alignas(16) unsigned char data[];
};

struct large {
    struct large *next, *prev;
    _Alignas(16) struct header header;
};

struct pool {
    size_t chunk_size;
    struct chunk *chunks;
    struct free_block *free_lists[CLASSES];
    struct large *large;
    long chunk_count, large_count;
};

NOINLINE struct pool *pool_create(size_t chunk_size) {
    struct pool *pool = malloc(sizeof *pool);
    if (pool == NULL)
        return NULL;
    memset(pool, 0, sizeof *pool);
    pool->chunk_size = chunk_size;
    return pool;
}

static void *carve(struct pool *pool, size_t class) {
    size_t block = sizeof(struct header) + (class + 1) * CLASS_SIZE;
    struct chunk *chunk = pool->chunks;
    if (chunk == NULL || chunk->capacity - chunk->used < block) {
        size_t capacity = pool->chunk_size > block ? pool->chunk_size : block;
        chunk = malloc(sizeof *chunk + capacity);
        if (chunk == NULL)
            return NULL;
        chunk->next = pool->chunks;
        chunk->used = 0;
        chunk->capacity = capacity;
        pool->chunks = chunk;
        pool->chunk_count++;
    }
    void *start = chunk->data + chunk->used;
    chunk->used += block;
    return start;
}

NOINLINE void *pool_alloc(struct pool *pool, size_t size) {
    struct header *header;
    if (size == 0)
        size = 1;
    size_t class = (size - 1) / CLASS_SIZE;
    if (class >= CLASSES) {
        struct large *large = malloc(sizeof *large + size);
        if (large == NULL)
            return NULL;
        large->prev = NULL;
        large->next = pool->large;
        if (pool->large)
            pool->large->prev = large;
        pool->large = large;
        pool->large_count++;
        header = &large->header;
        class = LARGE_CLASS;
    } else if (pool->free_lists[class] != NULL) {
        header = (struct header *)pool->free_lists[class];
        pool->free_lists[class] = pool->free_lists[class]->next;
    } else {
        header = carve(pool, class);
        if (header == NULL)
            return NULL;
    }
    header->size = size;
    header->class = class;
    return header + 1;
}

NOINLINE void pool_free(struct pool *pool, void *ptr) {
    if (ptr == NULL)
        return;
    struct header *header = (struct header *)ptr - 1;
    if (header->class == LARGE_CLASS) {
        struct large *large = (struct large *)((char *)header - offsetof(struct large, header));
        if (large->prev)
            large->prev->next = large->next;
        else
            pool->large = large->next;
        if (large->next)
            large->next->prev = large->prev;
        free(large);
        return;
    }
    struct free_block *block = (struct free_block *)header;
    block->next = pool->free_lists[header->class];
    pool->free_lists[header->class] = block;
}

NOINLINE void *pool_calloc(struct pool *pool, size_t count, size_t size) {
    if (size != 0 && count > SIZE_MAX / size)
        return NULL;
    void *ptr = pool_alloc(pool, count * size);
    if (ptr != NULL)
        memset(ptr, 0, count * size);
    return ptr;
}

NOINLINE void *pool_realloc(struct pool *pool, void *old, size_t size) {
    void *ptr = pool_alloc(pool, size);
    if (ptr == NULL || old == NULL)
        return ptr;
    size_t old_size = ((struct header *)old - 1)->size;
    memcpy(ptr, old, old_size < size ? old_size : size);
    pool_free(pool, old);
    return ptr;
}

NOINLINE void *node_new(struct pool *pool) {
    void *node = pool_alloc(pool, 48);
    if (node != NULL)
        memset(node, 0, 48);
    return node;
}

NOINLINE void node_delete(struct pool *pool, void *node) { pool_free(pool, node); }

NOINLINE void pool_destroy(struct pool *pool) {
    while (pool->chunks) {
        struct chunk *next = pool->chunks->next;
        free(pool->chunks);
        pool->chunks = next;
    }
    while (pool->large) {
        struct large *next = pool->large->next;
        free(pool->large);
        pool->large = next;
    }
    free(pool);
}

/* ---------------------------------------------------------------- the program */

#define ROUNDS 4

enum site { SITE_A, SITE_B_FROM_A, SITE_B_FROM_MAIN, SITE_SCRATCH, SITES };
static const char *const site_names[SITES] = {"a<-main", "b<-a<-main", "b<-main",
                                              "scratch_work<-main"};

struct counts {
    long allocated_objects, allocated_bytes, inuse_objects, inuse_bytes;
};
static struct counts per_site[SITES];

static struct {
    void *ptr;
    int site;
    long size;
} live[512];

void *volatile sink[512];
static int sunk;
static struct pool *pool;

static void fail(const char *what) {
    (void)!write(2, what, strlen(what));
    _exit(99);
}

static void note_alloc(void *ptr, enum site site, long size) {
    if (ptr == NULL)
        fail("pool allocation failed\n");
    for (int i = 0; i < 512; i++) {
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
    for (int i = 0; i < 512; i++) {
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
    if (sunk == 512)
        fail("sink full\n");
    sink[sunk++] = ptr;
}

/* b: pool_alloc 24 (kept), node_new (48, deleted), pool_calloc 5x12 (kept),
 * pool_alloc 40 reallocated to 120 (kept); from main every pool_alloc size is +8. */
NOINLINE void b(enum site site) {
    long extra = site == SITE_B_FROM_MAIN ? 8 : 0;
    void *p = pool_alloc(pool, 24 + extra);
    note_alloc(p, site, 24 + extra);
    keep(p);

    void *n = node_new(pool);
    note_alloc(n, site, 48);

    void *c = pool_calloc(pool, 5, 12 + extra);
    note_alloc(c, site, 5 * (12 + extra));
    keep(c);

    void *r = pool_alloc(pool, 40 + extra);
    note_alloc(r, site, 40 + extra);
    void *r2 = pool_realloc(pool, r, 120 + extra);
    note_free(r);
    note_alloc(r2, site, 120 + extra);
    keep(r2);

    node_delete(pool, n);
    note_free(n);
}

/* a: pool_alloc 200 (kept), pool_alloc 1000 (large, freed), pool_realloc(NULL, 64)
 * grown to 3000 (large, kept), node_new (kept), b, then the frees. */
NOINLINE void a(void) {
    void *p = pool_alloc(pool, 200);
    note_alloc(p, SITE_A, 200);
    keep(p);

    void *big = pool_alloc(pool, 1000);
    note_alloc(big, SITE_A, 1000);

    void *r = pool_realloc(pool, NULL, 64);
    note_alloc(r, SITE_A, 64);
    void *r2 = pool_realloc(pool, r, 3000);
    note_free(r);
    note_alloc(r2, SITE_A, 3000);
    keep(r2);

    void *n = node_new(pool);
    note_alloc(n, SITE_A, 48);
    keep(n);

    b(SITE_B_FROM_A);

    pool_free(pool, big);
    note_free(big);
}

/* A pool used and thrown away: everything given back, then destroyed. */
NOINLINE void scratch_work(void) {
    struct pool *scratch = pool_create(1024);
    if (scratch == NULL)
        fail("pool_create failed\n");
    void *blocks[20];
    for (int i = 0; i < 20; i++) {
        blocks[i] = pool_alloc(scratch, 16 + 16 * i); /* the last 4 are large blocks */
        note_alloc(blocks[i], SITE_SCRATCH, 16 + 16 * i);
    }
    for (int i = 0; i < 20; i++) {
        pool_free(scratch, blocks[i]);
        note_free(blocks[i]);
    }
    pool_destroy(scratch);
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

int main(void) {
    pool = pool_create(512); /* small chunks: pool_alloc mallocs several */
    if (pool == NULL)
        fail("pool_create failed\n");
    for (int i = 0; i < ROUNDS; i++)
        a();
    b(SITE_B_FROM_MAIN);
    scratch_work();

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
    put_number("chunks", pool->chunk_count);
    put_number(" large", pool->large_count);
    put("\ndone\n");
    size_t done = 0;
    while (done < used) {
        ssize_t n = write(1, out + done, used - done);
        if (n <= 0)
            return 98;
        done += n;
    }
    /* The main pool stays: its blocks are the program's in-use ones at exit. */
    return sink[0] == NULL;
}
