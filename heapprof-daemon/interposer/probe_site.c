/*
 * The probe site: where heapprofd's uprobe reads each report. A 5-byte NOP and a
 * return (x86-64; a NOP and a return on arm64): the kernel optimizes a uprobe there
 * into a call (not in the system-wide build: see below). The parts reach it through a hidden alias (no PLT); the exported name
 * is how heapprofd finds it in the file. Its call is probe() in probe_site.h.
 */
#include "preload_abi.h"

#if defined(__x86_64__)
/* The system-wide library's site is a 6-byte NOP, which the kernel does not optimize:
 * Linux 6.18 takes an optimized probe back out in three writes, and a process that
 * forks between them leaves its child a torn instruction (seen: the fork child of a
 * joined process died of SIGSEGV inside the site when heapprofd was killed). The
 * system library outlives its heapprofd in every process of the host, and samples by
 * default, so its rare reports pay the emulated probe instead. */
#if defined(HP_SYSTEM_PRELOAD)
#define HP_PROBE_SITE_NOP "    .byte 0x66, 0x0f, 0x1f, 0x44, 0x00, 0x00\n"
#else
#define HP_PROBE_SITE_NOP "    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n"
#endif
__asm__(".text\n"
        ".globl " HP_PROBE_SITE_SYMBOL "\n"
        ".type " HP_PROBE_SITE_SYMBOL ", @function\n"
        ".globl hp_probe_site_local\n"
        ".hidden hp_probe_site_local\n"
        ".p2align 4\n" HP_PROBE_SITE_SYMBOL ":\n"
        "hp_probe_site_local:\n"
        HP_PROBE_SITE_NOP
        "    ret\n"
        ".size " HP_PROBE_SITE_SYMBOL ", . - " HP_PROBE_SITE_SYMBOL "\n");
#elif defined(__aarch64__)
__asm__(".text\n"
        ".globl " HP_PROBE_SITE_SYMBOL "\n"
        ".type " HP_PROBE_SITE_SYMBOL ", %function\n"
        ".globl hp_probe_site_local\n"
        ".hidden hp_probe_site_local\n"
        ".p2align 4\n" HP_PROBE_SITE_SYMBOL ":\n"
        "hp_probe_site_local:\n"
        "    nop\n"
        "    ret\n"
        ".size " HP_PROBE_SITE_SYMBOL ", . - " HP_PROBE_SITE_SYMBOL "\n");
#else
#error "heapprofd's preload library supports x86-64 and arm64"
#endif
