/*
 * The digest of one part's pieces, included by pools/_xxh3.c (built for the baseline CPU)
 * and pools/_xxh3_avx2.c (built for AVX2, chosen at run time where the CPU has it). The
 * includer defines XXH_INLINE_ALL, includes <xxhash.h> and names the function in
 * KVBEAM_XXH3_DIGEST. The caller has checked every item number and the window.
 */
#include <stddef.h>
#include <stdint.h>

void KVBEAM_XXH3_DIGEST(const unsigned char *base, const int64_t *idx, ptrdiff_t n,
                        size_t item_len, size_t offset, size_t width, uint64_t out[2]) {
    XXH3_state_t state;
    XXH128_hash_t hash;
    XXH3_INITSTATE(&state);
    XXH3_128bits_reset(&state);
    if (width == item_len) { /* whole items: a run of consecutive items is one piece */
        ptrdiff_t i = 0;
        while (i < n) {
            ptrdiff_t j = i + 1;
            while (j < n && idx[j] == idx[j - 1] + 1)
                j++;
            XXH3_128bits_update(&state, base + (size_t)idx[i] * item_len,
                                (size_t)(j - i) * item_len);
            i = j;
        }
    } else if (width > 0) {
        for (ptrdiff_t i = 0; i < n; i++)
            XXH3_128bits_update(&state, base + (size_t)idx[i] * item_len + offset, width);
    }
    hash = XXH3_128bits_digest(&state);
    out[0] = hash.high64;
    out[1] = hash.low64;
}
