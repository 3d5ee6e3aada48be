/* The library's one translation unit of C: the implementation half of the header.
   _GNU_SOURCE lets the default thread count follow the CPU affinity (sched_getaffinity). */
#define _GNU_SOURCE
#define UT_IMPLEMENTATION
#include "utensil.h"
