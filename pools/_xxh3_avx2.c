/*
 * pools/_xxh3_loop.h compiled for AVX2 (python-xxhash's speed on large inputs, about 1.5x
 * the SSE2 build here); pools/_xxh3.c calls it only where the CPU reports AVX2. x86-64
 * only: on any other architecture (aarch64: GH200, GB200) this file compiles to nothing
 * and _xxh3.c keeps its baseline build (NEON there).
 */
#include "_xxh3_arch.h"

#if defined(KVBEAM_XXH3_AVX2)
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#define KVBEAM_XXH3_DIGEST kvbeam_xxh3_digest_avx2
#include "_xxh3_loop.h"
#else
typedef int kvbeam_xxh3_avx2_not_built; /* ISO C wants a declaration in every file */
#endif
