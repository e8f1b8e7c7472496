/* Following a joined process through exec: see exec_follow.h. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "exec_follow.h"
#include "got.h"
#include "preload_abi.h"

/* The C library functions used, bound at load time to the process's C library. */
extern char **environ;
extern int fcntl(int fd, int command, ...);
extern int close(int fd);
extern int *__errno_location(void);
extern void *dlsym(void *handle, const char *symbol);
extern long syscall(long number, ...);
#define RTLD_DEFAULT ((void *)0)
#define F_DUPFD 0
#define F_SETFD 2
#define FD_CLOEXEC 1

typedef int (*execve_t)(const char *, char *const[], char *const[]);
static execve_t real_execve, real_execvpe;

/* Environments larger than this are passed on as they are (the exec is not followed). */
#define MOST_VARIABLES 4096
#define MOST_PRELOAD_BYTES 4096

static const char PRELOAD[] = "LD_PRELOAD=";
#define PRELOAD_LENGTH (sizeof PRELOAD - 1)
static const char FOLLOW[] = HP_FOLLOW_ENV "=";
#define FOLLOW_LENGTH (sizeof FOLLOW - 1)
static const char KEPT[] = HP_KEPT_PRELOAD_PREFIX;
#define KEPT_LENGTH (sizeof KEPT - 1)

#if defined(__x86_64__)
#define SYS_STATX 332
#elif defined(__aarch64__)
#define SYS_STATX 291
#endif

/* Whether `path` names a set-user-ID or set-group-ID program: the loader runs it
 * without LD_PRELOAD, and it gets none of heapprofd's descriptors either. statx, as
 * its buffer is the same on every architecture (stx_mode at byte 28). */
static int set_id_program(const char *path)
{
    uint64_t buffer[32];
    const long at_cwd = -100, statx_mode = 2;
    if (syscall(SYS_STATX, at_cwd, path, 0L, statx_mode, buffer) != 0)
        return 0;
    uint16_t mode = (uint16_t)(buffer[3] >> 32); /* bytes 28-29, little-endian */
    return (mode & 06000) != 0;
}

static int has_slash(const char *s)
{
    for (; *s; s++)
        if (*s == '/')
            return 1;
    return 0;
}

static size_t length_of(const char *s)
{
    size_t n = 0;
    while (s[n])
        n++;
    return n;
}

static int starts_with(const char *s, const char *prefix, size_t length)
{
    for (size_t i = 0; i < length; i++)
        if (s[i] != prefix[i])
            return 0;
    return 1;
}

/* Appends `value` in decimal at `at`; returns the end. */
static char *put_number(char *at, uint64_t value)
{
    char digits[24];
    int n = 0;
    do
        digits[n++] = (char)('0' + value % 10);
    while ((value /= 10) != 0);
    while (n > 0)
        *at++ = digits[--n];
    return at;
}

static char *put_text(char *at, const char *text, size_t length)
{
    for (size_t i = 0; i < length; i++)
        *at++ = text[i];
    return at;
}

/* Copies of the descriptors that survive the exec (not close-on-exec). */
static int hand_over(const struct hp_follow *follow, struct hp_follow *handed)
{
    handed->rate = follow->rate;
    handed->children = follow->children;
    handed->library = fcntl(follow->library, F_DUPFD, HP_FIRST_HIGH_DESCRIPTOR);
    handed->replies = fcntl(follow->replies, F_DUPFD, HP_FIRST_HIGH_DESCRIPTOR);
    handed->pidfd = fcntl(follow->pidfd, F_DUPFD, HP_FIRST_HIGH_DESCRIPTOR);
    if (handed->library >= 0 && handed->replies >= 0 && handed->pidfd >= 0)
        return 1;
    int saved = *__errno_location();
    if (handed->library >= 0)
        close(handed->library);
    if (handed->replies >= 0)
        close(handed->replies);
    if (handed->pidfd >= 0)
        close(handed->pidfd);
    *__errno_location() = saved;
    return 0;
}

static void take_back(const struct hp_follow *handed)
{
    int saved = *__errno_location();
    close(handed->library);
    close(handed->replies);
    close(handed->pidfd);
    *__errno_location() = saved;
}

/*
 * Runs `exec` (execve or execvpe) with `envp` extended for the new image: LD_PRELOAD
 * first names the library's descriptor (the program's own LD_PRELOAD after it, and
 * kept whole under HP_KEPT_PRELOAD_PREFIX for the new image to restore), and
 * HP_FOLLOW_ENV names the descriptors and the rate. Where the process is not joined,
 * or the environment is too large, the call is passed on as it is.
 */
static int exec_following(execve_t exec, const char *file, char *const argv[],
                          char *const envp[])
{
    struct hp_follow follow, handed;
    if (!exec) {
        *__errno_location() = 38; /* ENOSYS */
        return -1;
    }
    /* A name without a slash is found on PATH by execvpe: looked at, if at all, by
     * the loader alone. */
    if (!envp || !hp_follow_state(&follow) || (has_slash(file) && set_id_program(file)))
        return exec(file, argv, envp);
    size_t variables = 0;
    const char *own_preload = NULL;
    for (; envp[variables]; variables++)
        if (starts_with(envp[variables], PRELOAD, PRELOAD_LENGTH))
            own_preload = envp[variables];
    size_t own_length = own_preload ? length_of(own_preload) : 0;
    if (variables > MOST_VARIABLES || own_length > MOST_PRELOAD_BYTES)
        return exec(file, argv, envp);
    if (!hand_over(&follow, &handed))
        return exec(file, argv, envp);

    /* "LD_PRELOAD=/proc/self/fd/N[:own]", "HEAPPROFD_FOLLOW=L,R,P,RATE", the kept one. */
    /* Sized by what they hold: an exec may come from a thread with a small stack. */
    char preload[PRELOAD_LENGTH + 32 + own_length];
    char *at = put_text(preload, PRELOAD, PRELOAD_LENGTH);
    at = put_text(at, "/proc/self/fd/", 14);
    at = put_number(at, (uint64_t)handed.library);
    if (own_preload && own_length > PRELOAD_LENGTH) {
        *at++ = ':';
        at = put_text(at, own_preload + PRELOAD_LENGTH, own_length - PRELOAD_LENGTH);
    }
    *at = 0;
    char follow_text[FOLLOW_LENGTH + 5 * 24];
    at = put_text(follow_text, FOLLOW, FOLLOW_LENGTH);
    at = put_number(at, (uint64_t)handed.library);
    *at++ = ',';
    at = put_number(at, (uint64_t)handed.replies);
    *at++ = ',';
    at = put_number(at, (uint64_t)handed.pidfd);
    *at++ = ',';
    at = put_number(at, handed.rate);
    *at++ = ',';
    at = put_number(at, (uint64_t)handed.children);
    *at = 0;
    char kept[KEPT_LENGTH + own_length + 1];
    if (own_preload) {
        at = put_text(kept, KEPT, KEPT_LENGTH);
        at = put_text(at, own_preload, own_length);
        *at = 0;
    }

    char *extended[variables + 4];
    size_t n = 0;
    extended[n++] = preload;
    extended[n++] = follow_text;
    if (own_preload)
        extended[n++] = kept;
    for (size_t i = 0; i < variables; i++) {
        const char *v = envp[i];
        if (starts_with(v, PRELOAD, PRELOAD_LENGTH) || starts_with(v, FOLLOW, FOLLOW_LENGTH) ||
            starts_with(v, KEPT, KEPT_LENGTH))
            continue;
        extended[n++] = (char *)v;
    }
    extended[n] = NULL;
    int result = exec(file, argv, extended);
    take_back(&handed); /* the exec failed: nothing was handed */
    return result;
}

/* ---- the wrappers, reached through the slots got.c redirects ------------------------ */

static int hp_execve(const char *path, char *const argv[], char *const envp[])
{
    return exec_following(real_execve, path, argv, envp);
}

static int hp_execv(const char *path, char *const argv[])
{
    return exec_following(real_execve, path, argv, environ);
}

static int hp_execvpe(const char *file, char *const argv[], char *const envp[])
{
    return exec_following(real_execvpe, file, argv, envp);
}

static int hp_execvp(const char *file, char *const argv[])
{
    return exec_following(real_execvpe, file, argv, environ);
}

/* The argument list of execl and its kin (up to its NULL) as an array on the stack,
 * sized by a first count. */
#define MOST_ARGUMENTS 4096
#define COUNT_ARGUMENTS(first, list, count)                                                \
    do {                                                                                   \
        va_list counting_;                                                                 \
        va_copy(counting_, list);                                                          \
        (count) = 1;                                                                       \
        for (const char *a_ = (first); a_ && (count) <= MOST_ARGUMENTS; (count)++)         \
            a_ = va_arg(counting_, const char *);                                          \
        va_end(counting_);                                                                 \
    } while (0)
#define FILL_ARGUMENTS(first, list, array, count)                                          \
    do {                                                                                   \
        (array)[0] = (char *)(first);                                                      \
        for (size_t i_ = 1; i_ < (count); i_++)                                            \
            (array)[i_] = va_arg(list, char *);                                            \
        (array)[(count) - 1] = NULL;                                                       \
    } while (0)

static int too_many_arguments(void)
{
    *__errno_location() = 7; /* E2BIG */
    return -1;
}

static int hp_execl(const char *path, const char *first, ...)
{
    size_t count;
    va_list list;
    va_start(list, first);
    COUNT_ARGUMENTS(first, list, count);
    if (count > MOST_ARGUMENTS) {
        va_end(list);
        return too_many_arguments();
    }
    char *argv[count];
    FILL_ARGUMENTS(first, list, argv, count);
    va_end(list);
    return hp_execv(path, argv);
}

static int hp_execlp(const char *file, const char *first, ...)
{
    size_t count;
    va_list list;
    va_start(list, first);
    COUNT_ARGUMENTS(first, list, count);
    if (count > MOST_ARGUMENTS) {
        va_end(list);
        return too_many_arguments();
    }
    char *argv[count];
    FILL_ARGUMENTS(first, list, argv, count);
    va_end(list);
    return hp_execvp(file, argv);
}

/* execle: the environment follows the argument list's NULL. */
static int hp_execle(const char *path, const char *first, ...)
{
    size_t count;
    va_list list;
    va_start(list, first);
    COUNT_ARGUMENTS(first, list, count);
    if (count > MOST_ARGUMENTS) {
        va_end(list);
        return too_many_arguments();
    }
    char *argv[count];
    FILL_ARGUMENTS(first, list, argv, count);
    char *const *envp = va_arg(list, char *const *);
    va_end(list);
    return hp_execve(path, argv, envp);
}

unsigned hp_exec_targets(struct got_target *targets, unsigned room)
{
    real_execve = (execve_t)dlsym(RTLD_DEFAULT, "execve");
    real_execvpe = (execve_t)dlsym(RTLD_DEFAULT, "execvpe");
    const struct {
        const char *name;
        void *replacement;
        int needs_execvpe;
    } wrappers[] = {
        { "execve", (void *)hp_execve, 0 },   { "execv", (void *)hp_execv, 0 },
        { "execl", (void *)hp_execl, 0 },     { "execle", (void *)hp_execle, 0 },
        { "execvpe", (void *)hp_execvpe, 1 }, { "execvp", (void *)hp_execvp, 1 },
        { "execlp", (void *)hp_execlp, 1 },
    };
    unsigned added = 0;
    if (!real_execve)
        return 0;
    for (unsigned i = 0; i < sizeof wrappers / sizeof wrappers[0] && added < room; i++) {
        if (wrappers[i].needs_execvpe && !real_execvpe)
            continue;
        void *original = dlsym(RTLD_DEFAULT, wrappers[i].name);
        if (!original)
            continue;
        targets[added++] =
            (struct got_target){ wrappers[i].name, original, wrappers[i].replacement };
    }
    return added;
}

/* ---- the new image ----------------------------------------------------------------- */

/* Reads "L,R,P,RATE,CHILDREN"; 1 when all five are there. */
static int parse_follow(const char *text, struct hp_follow *follow)
{
    uint64_t values[5];
    for (int i = 0; i < 5; i++) {
        if (*text < '0' || *text > '9')
            return 0;
        uint64_t value = 0;
        for (; *text >= '0' && *text <= '9'; text++)
            value = value * 10 + (uint64_t)(*text - '0');
        values[i] = value;
        if (i < 4 && *text++ != ',')
            return 0;
    }
    if (*text || values[0] > 1000000 || values[1] > 1000000 || values[2] > 1000000)
        return 0;
    follow->library = (int)values[0];
    follow->replies = (int)values[1];
    follow->pidfd = (int)values[2];
    follow->rate = values[3];
    follow->children = values[4] != 0;
    return 1;
}

/* Removes entry `at` of the environment (the array is the process's own, writable). */
static void remove_variable(char **env, size_t at)
{
    for (; env[at]; at++)
        env[at] = env[at + 1];
}

int hp_followed_start(struct hp_follow *follow)
{
    char **env = environ;
    if (!env)
        return -1;
    size_t follow_at = (size_t)-1;
    for (size_t i = 0; env[i]; i++)
        if (starts_with(env[i], FOLLOW, FOLLOW_LENGTH))
            follow_at = i;
    if (follow_at == (size_t)-1)
        return -1;
    int parsed = parse_follow(env[follow_at] + FOLLOW_LENGTH, follow);
    remove_variable(env, follow_at);
    /* LD_PRELOAD goes back to what the program had, or goes. */
    size_t preload_at = (size_t)-1;
    char *kept = NULL;
    size_t kept_at = (size_t)-1;
    for (size_t i = 0; env[i]; i++) {
        if (starts_with(env[i], PRELOAD, PRELOAD_LENGTH))
            preload_at = i;
        else if (starts_with(env[i], KEPT, KEPT_LENGTH) &&
                 starts_with(env[i] + KEPT_LENGTH, PRELOAD, PRELOAD_LENGTH)) {
            kept = env[i] + KEPT_LENGTH;
            kept_at = i;
        }
    }
    if (kept_at != (size_t)-1) {
        remove_variable(env, kept_at);
        if (preload_at != (size_t)-1 && preload_at > kept_at)
            preload_at--;
    }
    if (preload_at != (size_t)-1) {
        if (kept)
            env[preload_at] = kept;
        else
            remove_variable(env, preload_at);
    }
    if (!parsed)
        return 0;
    /* The new image's own children get none of them. */
    fcntl(follow->library, F_SETFD, FD_CLOEXEC);
    fcntl(follow->replies, F_SETFD, FD_CLOEXEC);
    fcntl(follow->pidfd, F_SETFD, FD_CLOEXEC);
    return 1;
}
