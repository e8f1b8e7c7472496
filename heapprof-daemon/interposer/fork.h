/*
 * Fork safety (fork.c): the handlers that keep a forked child's queue, known stacks
 * and probe site sound.
 */
#pragma once

#pragma GCC visibility push(hidden)

/* Registers the fork handlers, once per process. */
void register_fork_handlers(void);

#pragma GCC visibility pop
