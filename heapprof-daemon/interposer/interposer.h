/*
 * heapprofd's preload library: the interposer of launch mode (and of --pid, injected).
 *
 * heapprofd puts this object in the LD_PRELOAD of the commands it launches. It wraps
 * the C and C++ allocation functions, calls the real ones (whatever object the
 * dynamic linker finds next: glibc, musl, jemalloc, tcmalloc, mimalloc) and reports
 * each allocation through one call of the probe site, where heapprofd's uprobe reads
 * it (see heapprof-common's `preload` module for the interface; preload_abi.h is
 * generated from it). Frees are queued per thread and reported with the next call.
 *
 * The program answers each allocation report, in the thread's slot of a BPF map that
 * heapprofd hands the process (HEAPPROFD_REPLIES_FD), with the places of the stack
 * words its walk read. While an allocation's caller has the same registers and those words are
 * unchanged, the walk would find the same frames: such an allocation is queued with
 * the stack's hash, like a free, and costs no probe (the "known stacks").
 *
 * It links against nothing (no DT_NEEDED): the few C library functions it uses bind
 * to whatever C library the process has, so one build loads into glibc and musl
 * programs alike. It allocates nothing itself after start-up, and until the real
 * functions are known (dlsym may allocate) it serves from a small static arena.
 *
 * Sampling (HEAPPROFD_SAMPLE_RATE) is decided here, so that unsampled calls cost no
 * probe at all; frees are then reported only for the sampled blocks, which a small
 * lock-free set remembers.
 *
 * Its parts, one job each, each calling only the parts listed below it (no part
 * calls back up); this header is what they all share (the C library functions bound
 * at load, the macros, the linker's marks):
 *   system.c          the system-wide build's start: asking a running heapprofd
 *                     to join (--all --preload system)
 *   join.c            heapprofd_join: joining a running process (--pid)
 *   wrappers.c/.h     the C functions' and C++ operators' wrappers
 *   lifecycle.c/.h    start-up (the real functions, the program's answers) and exit
 *   exec_follow.c/.h  following a joined process through exec
 *   fork.c/.h         fork safety: the child's queue and probe site
 *   joined.c/.h       what a join holds, the look now and then, leaving
 *   report.c/.h       the per-thread queue, sampling and reporting (signal safety:
 *                     the queue's busy sections)
 *   thread.c/.h       each thread's state: its queue, its known stacks
 *   state.c/.h        the library's state, which every part reads
 *   got.c/.h          rewriting a running process's GOT slots
 *   probe_site.c/.h   the probe site heapprofd's uprobe reads, and the call of it
 * Names shared between the parts are hidden (-fvisibility=hidden, and the headers'
 * visibility pragma): only what carries EXPORT is seen by the process.
 */
#pragma once
#include <stddef.h>
#include <stdint.h>

#define EXPORT __attribute__((visibility("default")))
/* The allocation functions' wrappers: exported where LD_PRELOAD puts the library
 * first (launch mode), hidden in the system-wide build (HP_SYSTEM_PRELOAD, system.c),
 * which every program on the host loads and which binds nothing until it joins. */
#ifdef HP_SYSTEM_PRELOAD
#define WRAPPER __attribute__((visibility("hidden")))
#else
#define WRAPPER EXPORT
#endif
#define likely(x) __builtin_expect(!!(x), 1)
#define unlikely(x) __builtin_expect(!!(x), 0)

/* The C library functions used, bound at load time to the process's C library. */
typedef struct {
    const char *dli_fname;
    void *dli_fbase;
    const char *dli_sname;
    void *dli_saddr;
} dl_info_t;
extern void *dlsym(void *handle, const char *symbol);
extern int dladdr(const void *address, dl_info_t *info);
extern char *getenv(const char *name);
extern long sysconf(int name);
/* Fork handlers: glibc's own registration (its pthread_atfork is a static stub in
 * libc_nonshared.a, exported by libc.so.6 only as an x86-64 compatibility symbol),
 * or musl's pthread_atfork. Weak: the one the C library lacks is NULL. */
extern int __register_atfork(void (*prepare)(void), void (*parent)(void), void (*child)(void),
                             void *dso_handle) __attribute__((weak));
extern int pthread_atfork(void (*prepare)(void), void (*parent)(void), void (*child)(void))
    __attribute__((weak));
extern void *mmap(void *address, size_t length, int prot, int flags, int fd, long offset);
extern int pthread_key_create(unsigned *key, void (*destructor)(void *));
extern void *pthread_getspecific(unsigned key);
extern int pthread_setspecific(unsigned key, const void *value);
extern long readlink(const char *path, char *buffer, size_t size);
extern long recvmsg(int fd, void *message, int flags);
extern int poll(void *fds, unsigned long count, int timeout);
extern int close(int fd);
extern int mprotect(void *address, size_t length, int prot);
extern int getpid(void);
extern int socket(int domain, int type, int protocol);
extern int connect(int fd, const void *address, unsigned length);
extern int getsockopt(int fd, int level, int name, void *value, unsigned *length);
extern int setsockopt(int fd, int level, int name, const void *value, unsigned length);
extern long send(int fd, const void *buffer, size_t length, int flags);
extern int access(const char *path, int mode);
extern long syscall(long number, ...);
extern int *__errno_location(void);
#define RTLD_NEXT ((void *)-1L)
#define RTLD_DEFAULT ((void *)0)
#define SC_PAGESIZE 30 /* the same on glibc and musl */
#define PROT_READ 1
#define PROT_WRITE 2
#define MAP_SHARED 1
#define MAP_PRIVATE 2
#define MAP_FIXED 0x10
#define MAP_ANONYMOUS 0x20
#define MAP_FAILED ((void *)-1)

/* The linker's marks: this object's first byte and the end of its code. */
extern const char __ehdr_start[] __attribute__((visibility("hidden")));
extern const char etext[] __attribute__((visibility("hidden")));
