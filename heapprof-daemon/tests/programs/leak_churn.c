// A slow leak beside steady churn, for the session reports (tests/report_session.rs).
//
// Every 100 ms for STEPS steps (3.5 s):
// - leak_slowly() allocates LEAK_BYTES and never frees them: its in-use grows
//   steadily across the session;
// - churn() frees and reallocates every block of a working set whose size follows a
//   triangle wave of CHURN_PERIOD steps (1.3 s, out of phase with a 500 ms profile
//   interval): its in-use goes up and down between CHURN_MIN and CHURN_MAX blocks,
//   thousands of allocations a second, without growing.
// At the end the churn's working set is left live, as is the leak: whatever a
// profile at exit shows, churn did not grow.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define STEPS 35
#define LEAK_BYTES 4096
#define CHURN_BLOCK 2048
#define CHURN_MIN 64
#define CHURN_MAX 256
#define CHURN_PERIOD 13

static void *leaked[STEPS];
static void *working_set[CHURN_MAX];
static int live;

__attribute__((noinline)) void leak_slowly(int step) {
    leaked[step] = malloc(LEAK_BYTES);
    memset(leaked[step], step, LEAK_BYTES);
}

// Blocks the working set should hold at `step`: a triangle wave.
static int churn_target(int step) {
    int phase = step % CHURN_PERIOD;
    int half = CHURN_PERIOD / 2;
    int rise = phase <= half ? phase : CHURN_PERIOD - phase;
    return CHURN_MIN + (CHURN_MAX - CHURN_MIN) * rise / half;
}

__attribute__((noinline)) void churn(int step) {
    int target = churn_target(step);
    // Replace every live block: many allocations and frees, no change in size.
    for (int i = 0; i < live; i++) {
        free(working_set[i]);
        working_set[i] = malloc(CHURN_BLOCK);
        memset(working_set[i], i, CHURN_BLOCK);
    }
    while (live < target) {
        working_set[live] = malloc(CHURN_BLOCK);
        memset(working_set[live], live, CHURN_BLOCK);
        live++;
    }
    while (live > target) {
        live--;
        free(working_set[live]);
    }
}

int main(void) {
    struct timespec pause = {0, 100 * 1000 * 1000};
    for (int step = 0; step < STEPS; step++) {
        leak_slowly(step);
        churn(step);
        nanosleep(&pause, NULL);
    }
    printf("leaked %d bytes, churn holds %d blocks\n", STEPS * LEAK_BYTES, live);
    return 0;
}
