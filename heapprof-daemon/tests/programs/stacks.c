/* main calls a() and b(); a() calls b(). Each allocation is stored so that no
 * call is a tail call, and the sizes tell the sites apart:
 *   b <- a <- main: 100 bytes, a <- main: 1000 bytes, b <- main: 100 bytes. */
#include <stdlib.h>

void *volatile sink[4];

__attribute__((noinline)) void b(int slot) { sink[slot] = malloc(100); }
__attribute__((noinline)) void a(void) {
    sink[0] = malloc(1000);
    b(1);
    sink[3] = sink[0];
}
int main(void) {
    a();
#ifndef WITHOUT_MAIN_B /* the report tests' base: the same program, 100 bytes less */
    b(2);
#endif
    return sink[3] == NULL;
}
