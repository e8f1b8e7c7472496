/* Calls made inside other allocator calls, and calls that only look like them.
 * Built against jemalloc (-l:libjemalloc.so.2), whose C++ operators are probed with
 * its malloc. Usage: nesting ITERATIONS. Per iteration:
 * - news(): operator new(200, align 64), which calls aligned_alloc through the PLT
 *   (a call nested in it); nothrow new[](400), which jumps to nothrow new (a tail
 *   call); new(600): three user calls;
 * - siblings(): malloc(300), aligned_alloc(16, 300) and calloc(1, 300) one after
 *   another from the same frame, with the same size and the same callee-saved
 *   registers: three user calls, not one and its tail calls.
 * Every block is freed within the iteration. */
#include <cstdlib>
#include <new>

static void *volatile kept[3];

__attribute__((noinline)) static void news(int iterations) {
    for (int i = 0; i < iterations; i++) {
        void *volatile p = ::operator new(200, std::align_val_t(64));
        ::operator delete(p, std::align_val_t(64));
        char *volatile q = new (std::nothrow) char[400];
        delete[] q;
        void *volatile r = ::operator new(600);
        ::operator delete(r);
    }
}

__attribute__((noinline)) static void siblings(int iterations) {
    for (int i = 0; i < iterations; i++) {
        kept[0] = malloc(300);
        kept[1] = aligned_alloc(16, 300);
        kept[2] = calloc(1, 300);
        free(kept[0]);
        free(kept[1]);
        free(kept[2]);
    }
}

int main(int argc, char **argv) {
    int iterations = argc > 1 ? atoi(argv[1]) : 1000;
    news(iterations);
    siblings(iterations);
    return 0;
}
