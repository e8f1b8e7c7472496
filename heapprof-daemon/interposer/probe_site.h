/*
 * Calling the probe site (probe_site.c): one report to heapprofd, its words in the
 * registers the uprobe reads, and the caller's registers the wrappers pass along.
 */
#pragma once
#include <stdint.h>

#pragma GCC visibility push(hidden)

/* The probe site's hidden alias (probe_site.c). */
extern const unsigned char hp_probe_site_local[];

#pragma GCC visibility pop

#if defined(__x86_64__)
/* The call clobbers nothing: the site only returns (the red zone is off, see the
 * build flags, so the pushed return address overwrites nothing). */
static inline __attribute__((always_inline)) void
probe(uint64_t block, uint64_t size, uint64_t ra, uint64_t cfa, uint64_t fp,
      uint64_t queue, uint64_t meta)
{
    register uint64_t r8 __asm__("r8") = fp;
    register uint64_t r9 __asm__("r9") = queue;
    __asm__ volatile("call hp_probe_site_local"
                     :
                     : "D"(block), "S"(size), "d"(ra), "c"(cfa), "r"(r8), "r"(r9),
                       "a"(meta)
                     : "memory");
}
#elif defined(__aarch64__)
static inline __attribute__((always_inline)) void
probe(uint64_t block, uint64_t size, uint64_t ra, uint64_t cfa, uint64_t fp,
      uint64_t queue, uint64_t meta)
{
    register uint64_t x0 __asm__("x0") = block;
    register uint64_t x1 __asm__("x1") = size;
    register uint64_t x2 __asm__("x2") = ra;
    register uint64_t x3 __asm__("x3") = cfa;
    register uint64_t x4 __asm__("x4") = fp;
    register uint64_t x5 __asm__("x5") = queue;
    register uint64_t x6 __asm__("x6") = meta;
    __asm__ volatile("bl hp_probe_site_local"
                     :
                     : "r"(x0), "r"(x1), "r"(x2), "r"(x3), "r"(x4), "r"(x5), "r"(x6)
                     : "x30", "memory");
}
#else
#error "heapprofd's preload library supports x86-64 and arm64"
#endif

/* The caller's registers at the wrapper's return, taken in the wrapper itself (built
 * with frame pointers: the wrapper's frame record holds the caller's frame pointer). */
#define CALLER_RA() ((uint64_t)__builtin_extract_return_addr(__builtin_return_address(0)))
#define CALLER_SP() ((uint64_t)__builtin_dwarf_cfa())
#define CALLER_FP() (*(uint64_t *)__builtin_frame_address(0))
