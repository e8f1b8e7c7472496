/*
 * The probe site: where heapprofd's uprobe reads each report. A 5-byte NOP and a
 * return (x86-64; a NOP and a return on arm64): the kernel optimizes a uprobe there
 * into a call. The parts reach it through a hidden alias (no PLT); the exported name
 * is how heapprofd finds it in the file. Its call is probe() in probe_site.h.
 */
#include "preload_abi.h"

#if defined(__x86_64__)
__asm__(".text\n"
        ".globl " HP_PROBE_SITE_SYMBOL "\n"
        ".type " HP_PROBE_SITE_SYMBOL ", @function\n"
        ".globl hp_probe_site_local\n"
        ".hidden hp_probe_site_local\n"
        ".p2align 4\n" HP_PROBE_SITE_SYMBOL ":\n"
        "hp_probe_site_local:\n"
        "    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n"
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
