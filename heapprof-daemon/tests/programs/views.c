/* Known answers for the views beside the totals (temporaries, the peak's
 * composition, size classes). Nothing allocates before the peak but these
 * functions (no stdio until the end).
 *   churn():  10,000 blocks of 64 bytes, each freed before the next allocation:
 *             10,000 temporaries.
 *   big_a():  40 blocks of 256 KiB held (10 MiB); big_b(): 20 of them (5 MiB):
 *             the peak is 15 MiB, then both are freed.
 *   keep():   8 blocks of 1 MiB kept (8 MiB) to the end, under the peak.
 * Every block of big_a and big_b is in the 256 KiB size class: 40 and 20. */
#include <stdio.h>
#include <stdlib.h>

#define KIB 1024
#define MIB (1024 * KIB)

void *volatile a_blocks[40];
void *volatile b_blocks[20];
void *volatile kept[8];

__attribute__((noinline)) static void churn(void) {
    for (int i = 0; i < 10000; i++) {
        void *volatile block = malloc(64);
        free(block);
    }
}

__attribute__((noinline)) static void big_a(void) {
    for (int i = 0; i < 40; i++) a_blocks[i] = malloc(256 * KIB);
}

__attribute__((noinline)) static void big_b(void) {
    for (int i = 0; i < 20; i++) b_blocks[i] = malloc(256 * KIB);
}

__attribute__((noinline)) static void release(void) {
    for (int i = 0; i < 40; i++) free(a_blocks[i]);
    for (int i = 0; i < 20; i++) free(b_blocks[i]);
}

__attribute__((noinline)) static void keep(void) {
    for (int i = 0; i < 8; i++) kept[i] = malloc(MIB);
}

int main(void) {
    churn();
    big_a();
    big_b();
    release();
    keep();
    return 0;
}
