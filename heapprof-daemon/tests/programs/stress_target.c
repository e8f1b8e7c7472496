/*
 * A target heapprofd joins and leaves many times while it works (tests/inject_stress.rs).
 *
 * The main thread allocates without pause (blocks of 16 B to 8 KiB, filled with a
 * pattern and checked before they are freed); WORKERS more threads do the same. A
 * command thread reads one command per line and answers on one line:
 *
 * - "check": "ok ROUNDS ERRORS FORKS FORK_ERRORS BAD" (ROUNDS: allocation rounds of
 *   all threads so far; ERRORS: blocks found corrupted; FORKS: children forked by the
 *   fork loop that ran malloc and exec'd /bin/sh, which exited 7 as told; FORK_ERRORS
 *   those that did not, BAD the last one's wait status, -1 if fork failed);
 * - "got": "got same" while the process's GOT slots of malloc and free hold what
 *   they held at start-up, "got moved" while they point elsewhere (joined);
 * - "forks on" / "forks off": a thread that forks and execs without pause;
 * - "dlopen": dlopens and dlcloses libm from the command thread ("dlopened");
 * - "trap": stops the main thread inside the C library's malloc or free: SIGUSR1
 *   until the handler finds the interrupted instruction in libc's code, where it
 *   then waits in read() (a thread that waits in a system call, holding malloc's
 *   lock, as a handler that interrupted it would); "trapped TRIES" or "trap missed";
 * - "release": lets the trapped thread go ("released").
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <ucontext.h>
#include <unistd.h>

static atomic_long rounds;
static atomic_long errors;
static atomic_long forks;
static atomic_long fork_errors;
static atomic_int forking;
/* The last child that went wrong: its wait status, or -1 when fork or waitpid failed. */
static atomic_int bad_status;

static void *(*startup_malloc)(size_t);
static void (*startup_free)(void *);

static uintptr_t libc_start, libc_end;
static int trap_pipe[2];
static int trapped_pipe[2];
static volatile sig_atomic_t trap_armed;

/* The GOT's current slots: taking an external function's address in a PIE reads it. */
__attribute__((noinline)) static int got_moved(void)
{
    void *(*volatile m)(size_t) = malloc;
    void (*volatile f)(void *) = free;
    return m != startup_malloc || f != startup_free;
}

static void churn(unsigned seed, int use_calloc)
{
    enum { SLOTS = 64 };
    unsigned char *blocks[SLOTS] = {0};
    size_t sizes[SLOTS] = {0};
    for (;;) {
        for (int i = 0; i < SLOTS; i++) {
            if (blocks[i]) {
                unsigned char want = (unsigned char)(sizes[i] ^ i);
                for (size_t j = 0; j < sizes[i]; j += 61)
                    if (blocks[i][j] != want)
                        atomic_fetch_add(&errors, 1);
                free(blocks[i]);
            }
            seed = seed * 1103515245u + 12345u;
            sizes[i] = 16 + (seed >> 8) % 8192;
            blocks[i] = use_calloc && (i & 7) == 3 ? calloc(1, sizes[i]) : malloc(sizes[i]);
            if (!blocks[i]) {
                atomic_fetch_add(&errors, 1);
                continue;
            }
            if ((i & 15) == 5) {
                unsigned char *bigger = realloc(blocks[i], sizes[i] + 100);
                if (!bigger) {
                    atomic_fetch_add(&errors, 1);
                    continue;
                }
                blocks[i] = bigger;
            }
            /* Every 61st byte, by hand: no memset, so that the main thread's time in
             * the C library is its time in the allocator. */
            for (size_t j = 0; j < sizes[i]; j += 61)
                blocks[i][j] = (unsigned char)(sizes[i] ^ i);
        }
        atomic_fetch_add(&rounds, 1);
    }
}

static void *worker(void *arg)
{
    churn((unsigned)(uintptr_t)arg, 1);
    return NULL;
}

static void *fork_loop(void *arg)
{
    (void)arg;
    while (atomic_load(&forking)) {
        pid_t child = fork();
        if (child == 0) {
            /* The child allocates through whatever its GOT holds, then execs. */
            for (int i = 0; i < 100; i++)
                free(malloc(100 + i));
            execl("/bin/sh", "sh", "-c", "exit 7", (char *)NULL);
            _exit(99);
        }
        int status = 0;
        if (child < 0 || waitpid(child, &status, 0) != child) {
            atomic_store(&bad_status, -1);
            atomic_fetch_add(&fork_errors, 1);
        } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 7) {
            atomic_store(&bad_status, status);
            atomic_fetch_add(&fork_errors, 1);
        } else
            atomic_fetch_add(&forks, 1);
    }
    return NULL;
}

static void on_usr1(int signal, siginfo_t *info, void *context)
{
    (void)signal;
    (void)info;
    uintptr_t at = (uintptr_t)((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP];
    char hit = at >= libc_start && at < libc_end;
    if (!trap_armed || !hit) {
        char miss = 0;
        (void)!write(trapped_pipe[1], &miss, 1);
        return;
    }
    trap_armed = 0;
    (void)!write(trapped_pipe[1], &hit, 1);
    char go;
    while (read(trap_pipe[0], &go, 1) != 1) {
    }
}

static int find_libc(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    (void)data;
    if (!strstr(info->dlpi_name, "libc.so"))
        return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_X)) {
            libc_start = info->dlpi_addr + ph->p_vaddr;
            libc_end = libc_start + ph->p_memsz;
            return 1;
        }
    }
    return 0;
}

static pthread_t main_thread;

static void *commands(void *arg)
{
    (void)arg;
    pthread_t forker;
    int forker_running = 0;
    char line[128];
    while (fgets(line, sizeof line, stdin)) {
        if (!strcmp(line, "check\n")) {
            printf("ok %ld %ld %ld %ld %d\n", atomic_load(&rounds), atomic_load(&errors),
                   atomic_load(&forks), atomic_load(&fork_errors), atomic_load(&bad_status));
        } else if (!strcmp(line, "got\n")) {
            printf("got %s\n", got_moved() ? "moved" : "same");
        } else if (!strcmp(line, "forks on\n") && !forker_running) {
            atomic_store(&forking, 1);
            forker_running = pthread_create(&forker, NULL, fork_loop, NULL) == 0;
            printf("forking\n");
        } else if (!strcmp(line, "forks off\n") && forker_running) {
            atomic_store(&forking, 0);
            pthread_join(forker, NULL);
            forker_running = 0;
            printf("not forking\n");
        } else if (!strcmp(line, "dlopen\n")) {
            void *m = dlopen("libm.so.6", RTLD_NOW | RTLD_LOCAL);
            printf("%s\n", m && dlsym(m, "cos") ? "dlopened" : "dlopen failed");
            if (m)
                dlclose(m);
        } else if (!strcmp(line, "trap\n")) {
            int tries = 0;
            char hit = 0;
            while (!hit && tries < 100000) {
                tries++;
                trap_armed = 1;
                pthread_kill(main_thread, SIGUSR1);
                while (read(trapped_pipe[0], &hit, 1) != 1) {
                }
            }
            trap_armed = 0;
            if (hit)
                printf("trapped %d\n", tries);
            else
                printf("trap missed\n");
        } else if (!strcmp(line, "release\n")) {
            char go = 1;
            (void)!write(trap_pipe[1], &go, 1);
            printf("released\n");
        } else {
            printf("unknown command\n");
        }
    }
    exit(0);
}

int main(int argc, char **argv)
{
    int workers = argc > 1 ? atoi(argv[1]) : 3;
    startup_malloc = malloc;
    startup_free = free;
    setvbuf(stdout, NULL, _IOLBF, 0);
    dl_iterate_phdr(find_libc, NULL);
    if (!libc_end || pipe(trap_pipe) || pipe(trapped_pipe)) {
        printf("set-up failed\n");
        return 1;
    }
    struct sigaction action = {.sa_sigaction = on_usr1, .sa_flags = SA_SIGINFO | SA_RESTART};
    sigemptyset(&action.sa_mask);
    sigaction(SIGUSR1, &action, NULL);
    main_thread = pthread_self();
    for (int i = 0; i < workers; i++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, (void *)(uintptr_t)(i + 2)))
            return 1;
    }
    pthread_t reader;
    if (pthread_create(&reader, NULL, commands, NULL))
        return 1;
    printf("ready\n");
    churn(1, 0);
}
