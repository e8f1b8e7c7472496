/* The demo workload of `cargo xtask run`: a tiny "server" that parses requests,
 * caches some results and forgets to free one kind of buffer. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct entry { char *key; char *value; struct entry *next; };
static struct entry *cache;
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

static char *parse_request(int id) {
    char *buf = malloc(256);                 /* freed by handle_request */
    snprintf(buf, 256, "GET /item/%d", id);
    return buf;
}

static void cache_result(int id) {
    struct entry *e = calloc(1, sizeof *e);  /* kept: the cache is live data */
    e->key = strdup("item");
    e->value = malloc(64);
    snprintf(e->value, 64, "value-%d", id);
    pthread_mutex_lock(&cache_lock);
    e->next = cache;
    cache = e;
    pthread_mutex_unlock(&cache_lock);
}

static void log_request(const char *req) {
    char *line = malloc(strlen(req) + 32);   /* the leak: never freed */
    sprintf(line, "[log] %s", req);
}

static void handle_request(int id) {
    char *req = parse_request(id);
    log_request(req);
    if (id % 4 == 0)
        cache_result(id);
    free(req);
}

static void *worker(void *arg) {
    int base = *(int *)arg;
    for (int i = 0; i < 2000; i++)
        handle_request(base + i);
    return NULL;
}

int main(void) {
    pthread_t threads[2];
    int bases[2] = {0, 100000};
    for (int i = 0; i < 2; i++)
        pthread_create(&threads[i], NULL, worker, &bases[i]);
    for (int i = 0; i < 2; i++)
        pthread_join(threads[i], NULL);
    printf("leaky: handled 4000 requests\n");
    return 0;
}
