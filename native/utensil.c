/* The library's one translation unit of C: the implementation half of the header. */
#define UT_IMPLEMENTATION
#include "utensil.h"
