/*
 * GOT rewriting (see got.h): the relocations of every loaded object are read from its
 * dynamic section in memory, and the slots that name a target are rewritten in place.
 */
#include <stddef.h>
#include <stdint.h>

#include "got.h"

struct phdr64 {
    uint32_t type;
    uint32_t flags;
    uint64_t offset;
    uint64_t vaddr;
    uint64_t paddr;
    uint64_t filesz;
    uint64_t memsz;
    uint64_t align;
};

struct dl_phdr_info {
    uint64_t addr;
    const char *name;
    const struct phdr64 *phdr;
    uint16_t phnum;
};

struct dyn64 {
    int64_t tag;
    uint64_t value;
};

struct rela64 {
    uint64_t offset;
    uint64_t info;
    int64_t addend;
};

struct sym64 {
    uint32_t name;
    uint8_t info;
    uint8_t other;
    uint16_t shndx;
    uint64_t value;
    uint64_t size;
};

extern int dl_iterate_phdr(int (*callback)(struct dl_phdr_info *info, size_t size, void *data),
                           void *data);
extern int mprotect(void *address, size_t length, int prot);
extern long sysconf(int name);

#define PT_LOAD 1
#define PT_DYNAMIC 2
#define PT_GNU_RELRO 0x6474e552
#define PF_X 1
#define DT_NULL 0
#define DT_PLTRELSZ 2
#define DT_STRTAB 5
#define DT_SYMTAB 6
#define DT_RELA 7
#define DT_RELASZ 8
#define DT_JMPREL 23
#define PROT_READ 1
#define PROT_WRITE 2
#define SC_PAGESIZE 30

#if defined(__x86_64__)
#define R_ABS64 1
#define R_GLOB_DAT 6
#define R_JUMP_SLOT 7
#elif defined(__aarch64__)
#define R_ABS64 257
#define R_GLOB_DAT 1025
#define R_JUMP_SLOT 1026
#endif

struct pass {
    const struct got_target *targets;
    unsigned count;
    const void *self;
    int restore;
    uint64_t page;
    struct got_result result;
};

/* The loader relocates the pointers of a dynamic section in place (glibc) or not (musl). */
static inline uint64_t absolute(uint64_t pointer, uint64_t base)
{
    return pointer < base ? pointer + base : pointer;
}

static int same_name(const char *a, const char *b)
{
    while (*a && *a == *b) {
        a++;
        b++;
    }
    return *a == *b;
}

/* The object's RELRO range and code range, from its program headers. */
struct layout {
    uint64_t relro_start, relro_end;
    uint64_t text_start, text_end;
};

static struct layout layout_of(const struct dl_phdr_info *info, uint64_t page)
{
    struct layout l = { 0, 0, UINT64_MAX, 0 };
    for (uint16_t i = 0; i < info->phnum; i++) {
        const struct phdr64 *ph = &info->phdr[i];
        if (ph->type == PT_GNU_RELRO) {
            l.relro_start = (info->addr + ph->vaddr) & ~(page - 1);
            l.relro_end = (info->addr + ph->vaddr + ph->memsz) & ~(page - 1);
        } else if (ph->type == PT_LOAD && (ph->flags & PF_X)) {
            if (info->addr + ph->vaddr < l.text_start)
                l.text_start = info->addr + ph->vaddr;
            if (info->addr + ph->vaddr + ph->memsz > l.text_end)
                l.text_end = info->addr + ph->vaddr + ph->memsz;
        }
    }
    return l;
}

/* Writes `value` into `slot`, making a read-only (RELRO) page writable for the write. */
static int write_slot(struct pass *pass, const struct layout *l, uint64_t *slot, uint64_t value)
{
    uint64_t address = (uint64_t)(uintptr_t)slot;
    uint64_t page = address & ~(pass->page - 1);
    int relro = page >= l->relro_start && page < l->relro_end;
    if (relro && mprotect((void *)(uintptr_t)page, pass->page, PROT_READ | PROT_WRITE) != 0)
        return 0;
    __atomic_store_n(slot, value, __ATOMIC_RELEASE);
    if (relro)
        mprotect((void *)(uintptr_t)page, pass->page, PROT_READ);
    return 1;
}

static void rewrite_table(struct pass *pass, const struct dl_phdr_info *info,
                          const struct layout *l, const struct rela64 *table, uint64_t bytes,
                          const struct sym64 *symbols, const char *strings)
{
    for (uint64_t n = 0; n < bytes / sizeof *table; n++) {
        const struct rela64 *r = &table[n];
        uint32_t type = (uint32_t)r->info;
        uint32_t symbol = (uint32_t)(r->info >> 32);
        if (symbol == 0 || (type != R_JUMP_SLOT && type != R_GLOB_DAT && type != R_ABS64) ||
            r->addend != 0)
            continue;
        const char *name = strings + symbols[symbol].name;
        for (unsigned t = 0; t < pass->count; t++) {
            const struct got_target *target = &pass->targets[t];
            if (!same_name(name, target->name))
                continue;
            uint64_t *slot = (uint64_t *)(uintptr_t)(info->addr + r->offset);
            uint64_t now = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
            uint64_t original = (uint64_t)(uintptr_t)target->original;
            uint64_t replacement = (uint64_t)(uintptr_t)target->replacement;
            uint64_t next;
            if (pass->restore)
                next = now == replacement ? original : now;
            else
                next = now == original ||
                               (type == R_JUMP_SLOT && now >= l->text_start && now < l->text_end)
                           ? replacement
                           : now;
            if (next == now)
                break;
            if (write_slot(pass, l, slot, next))
                pass->result.rewritten++;
            else
                pass->result.unwritable++;
            break;
        }
    }
}

static int visit(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct pass *pass = data;
    const struct dyn64 *dynamic = NULL;
    int self = 0;
    for (uint16_t i = 0; i < info->phnum; i++) {
        const struct phdr64 *ph = &info->phdr[i];
        if (ph->type == PT_DYNAMIC)
            dynamic = (const struct dyn64 *)(uintptr_t)(info->addr + ph->vaddr);
        if (ph->type == PT_LOAD && info->addr + ph->vaddr <= (uint64_t)(uintptr_t)pass->self &&
            (uint64_t)(uintptr_t)pass->self < info->addr + ph->vaddr + ph->memsz)
            self = 1;
    }
    if (!dynamic || self)
        return 0;
    uint64_t strtab = 0, symtab = 0, rela = 0, relasz = 0, jmprel = 0, pltrelsz = 0;
    for (const struct dyn64 *d = dynamic; d->tag != DT_NULL; d++) {
        switch (d->tag) {
        case DT_STRTAB: strtab = absolute(d->value, info->addr); break;
        case DT_SYMTAB: symtab = absolute(d->value, info->addr); break;
        case DT_RELA: rela = absolute(d->value, info->addr); break;
        case DT_RELASZ: relasz = d->value; break;
        case DT_JMPREL: jmprel = absolute(d->value, info->addr); break;
        case DT_PLTRELSZ: pltrelsz = d->value; break;
        default: break;
        }
    }
    if (!strtab || !symtab)
        return 0;
    pass->result.objects++;
    struct layout l = layout_of(info, pass->page);
    const struct sym64 *symbols = (const struct sym64 *)(uintptr_t)symtab;
    const char *strings = (const char *)(uintptr_t)strtab;
    if (jmprel)
        rewrite_table(pass, info, &l, (const struct rela64 *)(uintptr_t)jmprel, pltrelsz, symbols,
                      strings);
    if (rela)
        rewrite_table(pass, info, &l, (const struct rela64 *)(uintptr_t)rela, relasz, symbols,
                      strings);
    return 0;
}

static int busy;
/* A pass asked for while another ran: the one running does it (a dlopen in a
 * constructor that another dlopen runs holds the loader's lock, which the running
 * pass may be waiting for: waiting for it in turn would deadlock). */
static int pending;

struct got_result got_rewrite(const struct got_target *targets, unsigned count, const void *self,
                              int restore, int wait)
{
    long page = sysconf(SC_PAGESIZE);
    struct pass pass = {
        .targets = targets,
        .count = count,
        .self = self,
        .restore = restore,
        .page = page > 0 ? (uint64_t)page : 4096,
    };
    for (;;) {
        if (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE)) {
            if (wait)
                continue;
            __atomic_store_n(&pending, 1, __ATOMIC_RELEASE);
            return pass.result;
        }
        do {
            __atomic_store_n(&pending, 0, __ATOMIC_RELEASE);
            got_walk_begin();
            dl_iterate_phdr(visit, &pass);
            got_walk_end();
        } while (__atomic_load_n(&pending, __ATOMIC_ACQUIRE));
        __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
        /* Asked for between the last pass and the release. */
        if (!__atomic_load_n(&pending, __ATOMIC_ACQUIRE))
            return pass.result;
    }
}

/* 1 while the library walks the loader's list, or while a fork is under way. */
static int walking;
/* Whether the forking thread holds `walking` (it gives up waiting after a bound: a
 * fork from a signal handler that interrupted a walk of its own thread). */
static int held_for_fork;

int got_walk_try(void)
{
    return !__atomic_exchange_n(&walking, 1, __ATOMIC_ACQUIRE);
}

/* Gives the CPU away while another thread holds `walking`: a holder preempted on a
 * busy machine would otherwise be kept waiting by the spinners it blocks. A raw
 * sched_yield, so that no lazily bound call (into the loader) is made while the
 * loader's list may be being walked. */
static void walk_wait(unsigned long tries)
{
    if (tries < 64) {
        __asm__ volatile("" ::: "memory");
        return;
    }
#if defined(__x86_64__)
    long result;
    __asm__ volatile("syscall" : "=a"(result) : "a"(24L) : "rcx", "r11", "memory");
    (void)result;
#elif defined(__aarch64__)
    register long number __asm__("x8") = 124;
    register long result __asm__("x0");
    __asm__ volatile("svc 0" : "=r"(result) : "r"(number) : "memory");
    (void)result;
#else
    __asm__ volatile("" ::: "memory");
#endif
}

void got_walk_begin(void)
{
    for (unsigned long tries = 0; !got_walk_try(); tries++)
        walk_wait(tries);
}

void got_walk_end(void)
{
    __atomic_store_n(&walking, 0, __ATOMIC_RELEASE);
}

void got_walk_hold_for_fork(void)
{
    /* About 2^16 yields: tens of milliseconds when the machine is idle. */
    for (unsigned long tries = 0; tries < (1ul << 16); tries++) {
        if (got_walk_try()) {
            held_for_fork = 1;
            return;
        }
        walk_wait(tries);
    }
}

void got_walk_release_after_fork(void)
{
    if (!held_for_fork)
        return;
    held_for_fork = 0;
    got_walk_end();
}
