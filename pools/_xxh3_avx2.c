/*
 * pools/_xxh3_loop.h compiled for AVX2 (python-xxhash's speed on large inputs, about 1.5x
 * the SSE2 build here); pools/_xxh3.c calls it only where the CPU reports AVX2.
 */
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#define KVBEAM_XXH3_DIGEST kvbeam_xxh3_digest_avx2
#include "_xxh3_loop.h"
