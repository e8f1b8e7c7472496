// alloc_abc.c's main/a/b in C++, through operator new and delete (tests/allocators.rs):
// jemalloc, tcmalloc and mimalloc define their own operators new/delete, which do not
// go through their malloc, so they must be probed as allocator functions too.
//
// Each site: `new char[]` (operator new[]), `new Node` (operator new), an over-aligned
// `new Wide` (operator new(size_t, align_val_t)), a nothrow new, and deletes (sized and
// unsized, aligned). The program counts what it asked for (an operator new of n bytes
// is an allocation of n bytes) and prints the counts with write(2), in alloc_abc.c's
// format:
//   pid=P allocated_objects=N allocated_bytes=B inuse_objects=N inuse_bytes=B
//   stack=a<-main ...
//   stack=b<-a<-main ...
//   stack=b<-main ...
//   done
#include <cstddef>
#include <cstring>
#include <new>
#include <unistd.h>

#define NOINLINE __attribute__((noinline, noclone))

namespace {

enum Site { SITE_A, SITE_B_FROM_A, SITE_B_FROM_MAIN, SITES };
const char *const site_names[SITES] = {"a<-main", "b<-a<-main", "b<-main"};

struct Counts {
    long allocated_objects, allocated_bytes, inuse_objects, inuse_bytes;
};
Counts per_site[SITES];

struct Live {
    const void *ptr;
    int site;
    long size;
};
Live live[256];

void fail(const char *what) {
    (void)!write(2, what, strlen(what));
    _exit(99);
}

void note_alloc(const void *ptr, Site site, long size) {
    if (ptr == nullptr)
        fail("allocation failed\n");
    for (Live &entry : live) {
        if (entry.ptr == nullptr) {
            entry = {ptr, site, size};
            per_site[site].allocated_objects++;
            per_site[site].allocated_bytes += size;
            per_site[site].inuse_objects++;
            per_site[site].inuse_bytes += size;
            return;
        }
    }
    fail("live table full\n");
}

void note_free(const void *ptr) {
    for (Live &entry : live) {
        if (entry.ptr == ptr) {
            per_site[entry.site].inuse_objects--;
            per_site[entry.site].inuse_bytes -= entry.size;
            entry.ptr = nullptr;
            return;
        }
    }
    fail("freeing an unknown block\n");
}

struct Node {
    Node *next;
    long values[4];
}; // 40 bytes

struct alignas(64) Wide {
    char bytes[192];
}; // 192 bytes, aligned to 64: operator new(size_t, align_val_t)

} // namespace

const void *volatile sink[256];
int sunk;

static void keep(const void *ptr) {
    if (sunk == 256)
        fail("sink full\n");
    sink[sunk++] = ptr;
}

// a and b have C names, so their frames are `a` and `b` as in alloc_abc.c.
extern "C" {

// b: new char[100] (kept), new Node (deleted), new Wide (kept), nothrow new char[60]
// (deleted); from main the arrays are 8 bytes larger.
NOINLINE void b(int site_number) {
    Site site = Site(site_number);
    long extra = site == SITE_B_FROM_MAIN ? 8 : 0;
    char *array = new char[100 + extra];
    note_alloc(array, site, 100 + extra);
    keep(array);

    Node *node = new Node;
    note_alloc(node, site, sizeof(Node));

    Wide *wide = new Wide;
    note_alloc(wide, site, sizeof(Wide));
    keep(wide);

    char *maybe = new (std::nothrow) char[60 + extra];
    note_alloc(maybe, site, 60 + extra);

    note_free(node);
    delete node;
    note_free(maybe);
    delete[] maybe;
}

// a: new char[1000] (kept), 3 Nodes (2 deleted), new Wide (deleted), b.
NOINLINE void a() {
    char *array = new char[1000];
    note_alloc(array, SITE_A, 1000);
    keep(array);

    Node *nodes[3];
    for (Node *&node : nodes) {
        node = new Node;
        note_alloc(node, SITE_A, sizeof(Node));
    }
    keep(nodes[0]);

    Wide *wide = new Wide;
    note_alloc(wide, SITE_A, sizeof(Wide));

    b(SITE_B_FROM_A);

    note_free(nodes[1]);
    delete nodes[1];
    note_free(nodes[2]);
    delete nodes[2];
    note_free(wide);
    delete wide;
}

} // extern "C"


// Output without stdio or iostreams.
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
        digits[n++] = char('0' + v % 10);
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

static void put_counts(const Counts &c) {
    put_number(" allocated_objects", c.allocated_objects);
    put_number(" allocated_bytes", c.allocated_bytes);
    put_number(" inuse_objects", c.inuse_objects);
    put_number(" inuse_bytes", c.inuse_bytes);
    put("\n");
}

int main() {
    for (int i = 0; i < 3; i++)
        a();
    b(SITE_B_FROM_MAIN);

    Counts total = {0, 0, 0, 0};
    for (const Counts &c : per_site) {
        total.allocated_objects += c.allocated_objects;
        total.allocated_bytes += c.allocated_bytes;
        total.inuse_objects += c.inuse_objects;
        total.inuse_bytes += c.inuse_bytes;
    }
    put_number("pid", (long)getpid());
    put_counts(total);
    for (int s = 0; s < SITES; s++) {
        put("stack=");
        put(site_names[s]);
        put_counts(per_site[s]);
    }
    put("done\n");
    size_t done = 0;
    while (done < used) {
        ssize_t n = write(1, out + done, used - done);
        if (n <= 0)
            return 98;
        done += size_t(n);
    }
    return sink[0] == nullptr;
}
