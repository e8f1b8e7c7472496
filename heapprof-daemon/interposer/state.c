/*
 * The library's state (see state.h): defined here, below every part that sets or
 * reads it.
 */
#include "state.h"

#ifdef HP_SYSTEM_PRELOAD
EXPORT volatile uint32_t heapprofd_injected = SYSTEM_MARK;
#else
EXPORT volatile uint32_t heapprofd_injected = LAUNCHED_MARK;
#endif

volatile int state = UNINITIALIZED;
uint64_t sample_rate;
uint64_t page_size = 4096;
int cxx_through_malloc = 1;
struct hp_stack_reply *replies;
void *cxx_base;
uint64_t allocator_text_start, allocator_text_end;
struct real_functions real;
