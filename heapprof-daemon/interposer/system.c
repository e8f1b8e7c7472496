/*
 * The system-wide build's start (HP_SYSTEM_PRELOAD: `heapprofd --all --preload
 * system` names this build in /etc/ld.so.preload, so every dynamic program on the
 * host loads it). No allocation function is exported, so the copy binds nothing by
 * itself: at start it asks a running heapprofd, on its socket, to join, and then joins
 * as an injected copy does (join.c), its calls redirected through the process's GOT.
 * Without heapprofd (none runs, or one was killed and left the entry) the socket is
 * missing or refuses, and the copy stays inert: one failed access() or connect() at
 * start, nothing after.
 */
#include "interposer.h"
#include "join.h"
#include "joined.h"
#include "state.h"
#include "preload_abi.h"

#ifdef HP_SYSTEM_PRELOAD

#define AF_UNIX_ 1
#define SOCK_SEQPACKET_ 5
#define SOCK_CLOEXEC_ 02000000
#define SOL_SOCKET_ 1
#define SO_PEERCRED_ 17
#define SO_RCVTIMEO_ 20
#define SO_SNDTIMEO_ 21
#define SCM_RIGHTS_ 1
#define MSG_CMSG_CLOEXEC_ 0x40000000
#define MSG_NOSIGNAL_ 0x4000

/* How long a program's start waits for heapprofd's answer: a heapprofd stopped (not
 * dead) delays each start by this much once, then the program runs unjoined. */
#define ANSWER_WAIT_SECONDS 1

/* Receives heapprofd's join message: the rate and flags, the answers' map and
 * heapprofd's pidfd. Returns 0 with both descriptors, else -1 (none kept). */
static int receive_join(int socket, struct hp_system_join *join, int *replies, int *pidfd)
{
    struct iovec_ {
        void *base;
        size_t length;
    } io = { join, sizeof *join };
    union {
        struct {
            uint64_t length;
            int level;
            int type;
            int fds[2];
        } header;
        uint64_t align[3];
    } control = { .align = { 0 } };
    struct {
        void *name;
        uint32_t name_length;
        uint32_t pad0;
        struct iovec_ *iov;
        size_t iov_length;
        void *control;
        size_t control_length;
        int flags;
        int pad1;
    } message = { .iov = &io, .iov_length = 1, .control = &control,
                  .control_length = sizeof control };
    long got = recvmsg(socket, &message, MSG_CMSG_CLOEXEC_);
    int fds_received = control.header.level == SOL_SOCKET_ &&
                       control.header.type == SCM_RIGHTS_ &&
                       control.header.length >= 16 + 2 * sizeof(int);
    if (got != (long)sizeof *join || !fds_received) {
        if (fds_received) {
            close(control.header.fds[0]);
            close(control.header.fds[1]);
        }
        return -1;
    }
    *replies = control.header.fds[0];
    *pidfd = control.header.fds[1];
    return 0;
}

/* Whether the program runs under valgrind, whose tools preload their vgpreload_*
 * objects: it executes the program's code by translating it, and would stop at the
 * probe site's breakpoint (SIGTRAP). Such a program is left alone. */
static int under_valgrind(void)
{
    const char *preload = getenv("LD_PRELOAD");
    for (const char *c = preload; c && *c; c++)
        if (c[0] == 'v' && c[1] == 'g' && c[2] == 'p' && c[3] == 'r' && c[4] == 'e' &&
            c[5] == 'l' && c[6] == 'o' && c[7] == 'a' && c[8] == 'd')
            return 1;
    return 0;
}

/* Whether the program keeps out of the system-wide preload (HP_SYSTEM_OPT_OUT_ENV set
 * to HP_SYSTEM_OPT_OUT_VALUE): heapprofd reads the same variable from its environment
 * and leaves it alone, neither joined nor probed. */
static int opted_out(void)
{
    const char *value = getenv(HP_SYSTEM_OPT_OUT_ENV);
    const char *off = HP_SYSTEM_OPT_OUT_VALUE;
    if (!value)
        return 0;
    while (*off && *value == *off) {
        value++;
        off++;
    }
    return *off == 0 && *value == 0;
}

/* Asks heapprofd to join; the program's start waits for the answer (at most
 * ANSWER_WAIT_SECONDS), so that its first allocations are counted. Returns the join's
 * result (sent back to heapprofd too), or JOIN_NOT_ASKED. */
static long ask_to_join(void)
{
    if (opted_out() || access(HP_SYSTEM_SOCKET, 0 /* F_OK */) != 0 || under_valgrind())
        return JOIN_NOT_ASKED;
    int fd = socket(AF_UNIX_, SOCK_SEQPACKET_ | SOCK_CLOEXEC_, 0);
    if (fd < 0)
        return JOIN_NOT_ASKED;
    struct {
        long seconds;
        long microseconds;
    } wait = { ANSWER_WAIT_SECONDS, 0 };
    setsockopt(fd, SOL_SOCKET_, SO_RCVTIMEO_, &wait, sizeof wait);
    setsockopt(fd, SOL_SOCKET_, SO_SNDTIMEO_, &wait, sizeof wait);
    struct {
        unsigned short family;
        char path[108];
    } address = { AF_UNIX_, HP_SYSTEM_SOCKET };
    struct {
        int pid;
        unsigned uid, gid;
    } peer = { 0, 1, 1 };
    unsigned peer_length = sizeof peer;
    struct hp_system_join join;
    int replies, pidfd;
    long result = JOIN_NOT_ASKED;
    /* Only root's heapprofd is answered: anyone else could have bound the name. */
    if (connect(fd, &address, sizeof address) == 0 &&
        getsockopt(fd, SOL_SOCKET_, SO_PEERCRED_, &peer, &peer_length) == 0 && peer.uid == 0) {
        if (receive_join(fd, &join, &replies, &pidfd) == 0)
            result = hp_join_with(replies, pidfd, -1, join.sample_rate, join.flags);
        else
            result = JOIN_NO_DESCRIPTORS;
        send(fd, &result, sizeof result, MSG_NOSIGNAL_);
    }
    close(fd);
    return result;
}

/* An ask in progress: heapprofd may hold this very thread meanwhile (it joins the
 * processes that ran before it through ptrace) and must not ask again inside it. */
static volatile int asking;
/* The last ask's result. */
static long last_answer = JOIN_NOT_ASKED;

static long ask_once(void)
{
    __atomic_store_n(&asking, 1, __ATOMIC_RELEASE);
    long result = ask_to_join();
    last_answer = result;
    __atomic_store_n(&asking, 0, __ATOMIC_RELEASE);
    return result;
}

__attribute__((constructor)) static void on_system_load(void) { ask_once(); }

/*
 * Called by heapprofd through ptrace in a process that ran before it. With `again` 0,
 * after heapprofd has dlopen'd this copy, whose start asked already: that answer.
 * With `again` 1, for a copy loaded earlier (inert, or joined to a heapprofd that has
 * exited since): asks now. Returns the slots redirected, or a join_error.
 */
EXPORT long heapprofd_system_ask(uint64_t again)
{
    if (__atomic_load_n(&asking, __ATOMIC_ACQUIRE))
        return JOIN_ASKING;
    if (!again)
        return last_answer;
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == ACTIVE) {
        /* The wrappers notice heapprofd's exit only at their next look, which an
         * idle process may not reach. */
        if (!daemon_gone())
            return JOIN_ALREADY;
        heapprofd_leave_now();
    }
    return ask_once();
}

#endif
