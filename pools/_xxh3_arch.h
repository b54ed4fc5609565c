/*
 * Whether the digest loop has an AVX2 build (pools/_xxh3_avx2.c): on x86-64 only. Any other
 * architecture (aarch64: GH200, GB200) builds the baseline loop alone, as does an x86-64
 * build with KVBEAM_XXH3_BASELINE_ONLY defined (what tests/unit/test_digest.py compiles to
 * check that path where no cross compiler is at hand).
 */
#ifndef KVBEAM_XXH3_ARCH_H
#define KVBEAM_XXH3_ARCH_H
#if defined(__x86_64__) && !defined(KVBEAM_XXH3_BASELINE_ONLY)
#define KVBEAM_XXH3_AVX2 1
#endif
#endif
