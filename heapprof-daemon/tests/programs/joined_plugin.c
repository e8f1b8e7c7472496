/* tests/programs/joined.c's plugin, dlopened after heapprofd joined: a new object
 * whose calls heapprofd's library must also redirect. */
#include <stdlib.h>

__attribute__((visibility("default"))) void plugin_work(void)
{
    void *volatile p = malloc(72);
    free(p);
}
