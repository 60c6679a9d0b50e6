/* out[m, n] = sum_k x[m, k] * w[n, k] in float32 on the CPU, each output in one fixed order
 * whatever the number of rows: lane l of a vector accumulator (16 lanes with AVX-512, 8 with
 * AVX2) sums x[m, k] * w[n, k] for k = l, l + LANES, ... by fused multiply-add in increasing k
 * (the last partial vector masked to zeros), then the lanes are added in one fixed tree. So a
 * row's result is the same bits in a batch of 1 or of 300 rows, and in any block of the tiling
 * (specsplit/model/cpu_gemm.py builds and loads this; the blocks only change which outputs are
 * computed together: MR rows x NR weight rows share each vector load).
 *
 * Threads: OpenMP over blocks of weight rows (the process's OpenMP runtime, torch's: its
 * libgomp.so.1 is the one already loaded). The threads split the weight rows, never a sum.
 */
#include <immintrin.h>
#include <stdint.h>

#define MR 4 /* rows of x a block */
#define NR 4 /* rows of w a block */
#define MCHUNK 256 /* rows of x a pass over the weights (each weight row read once a pass) */

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))

/* ---------------------------------------------------------------- AVX-512: 16 lanes */

AVX512 ALWAYS_INLINE float hsum16(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

AVX512 ALWAYS_INLINE void block16(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out,
                           int64_t ldo, int64_t k_len, const int mr, const int nr) {
    __m512 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        __m512 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_loadu_ps(w + j * ldw + k);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < k_len) {
        __mmask16 mask = (__mmask16)((1u << (k_len - k)) - 1);
        __m512 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm512_maskz_loadu_ps(mask, w + j * ldw + k);
        for (int i = 0; i < mr; i++) {
            __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * ldo + j] = hsum16(acc[i][j]);
}

/* ---------------------------------------------------------------- AVX2 + FMA: 8 lanes */

AVX2 ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

AVX2 ALWAYS_INLINE void block8(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out,
                          int64_t ldo, int64_t k_len, const int mr, const int nr) {
    __m256 acc[MR][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= k_len; k += 8) {
        __m256 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
        for (int i = 0; i < mr; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < k_len) {
        int32_t lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = k + l < k_len ? -1 : 0;
        __m256i mask = _mm256_loadu_si256((const __m256i *)lanes);
        __m256 wv[NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm256_maskload_ps(w + j * ldw + k, mask);
        for (int i = 0; i < mr; i++) {
            __m256 xv = _mm256_maskload_ps(x + i * ldx + k, mask);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * ldo + j] = hsum8(acc[i][j]);
}

/* ---------------------------------------------------------------- the loops */

/* every (mr, nr) of 1..MR x 1..NR as its own unrolled block, so the accumulators stay in
 * registers; `BLOCK` is block16 or block8 */
#define CALL(BLOCK, MRV, NRV) BLOCK(x, ldx, w, ldw, out, ldo, k_len, MRV, NRV)
#define BY_NR(BLOCK, MRV)                                                                  \
    switch (nr) {                                                                          \
    case 1: CALL(BLOCK, MRV, 1); break;                                                    \
    case 2: CALL(BLOCK, MRV, 2); break;                                                    \
    case 3: CALL(BLOCK, MRV, 3); break;                                                    \
    default: CALL(BLOCK, MRV, NR); break;                                                  \
    }
#define DISPATCH(BLOCK)                                                                    \
    switch (mr) {                                                                          \
    case 1: BY_NR(BLOCK, 1) break;                                                         \
    case 2: BY_NR(BLOCK, 2) break;                                                         \
    case 3: BY_NR(BLOCK, 3) break;                                                         \
    default: BY_NR(BLOCK, MR) break;                                                       \
    }

AVX512 static void tile16(const float *x, int64_t ldx,
                                                      const float *w, int64_t ldw, float *out,
                                                      int64_t ldo, int64_t k_len, int mr,
                                                      int nr) {
    DISPATCH(block16)
}

AVX2 static void tile8(const float *x, int64_t ldx,
                                                     const float *w, int64_t ldw, float *out,
                                                     int64_t ldo, int64_t k_len, int mr,
                                                     int nr) {
    DISPATCH(block8)
}

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                        int64_t, int, int);

/* The lanes this CPU's kernel uses: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (neither: not usable). */
int fixed_gemm_lanes(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
    return 0;
}

/* x [m_len, k_len] (row stride ldx), w [n_len, k_len] (row stride ldw) -> out [m_len, n_len]
 * (row stride ldo), with `lanes` from fixed_gemm_lanes() (or 8 where it said 16), on `threads`
 * threads (torch's count: OpenMP's per-thread setting is not the engine thread's). */
void fixed_gemm(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out, int64_t ldo,
                int64_t m_len, int64_t n_len, int64_t k_len, int lanes, int threads) {
    tile_fn tile = lanes == 16 ? tile16 : tile8;
    int64_t n_blocks = (n_len + NR - 1) / NR;
    for (int64_t m0 = 0; m0 < m_len; m0 += MCHUNK) {
        int64_t m1 = m0 + MCHUNK < m_len ? m0 + MCHUNK : m_len;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int64_t nb = 0; nb < n_blocks; nb++) {
            int64_t n = nb * NR;
            int nr = n_len - n < NR ? (int)(n_len - n) : NR;
            for (int64_t m = m0; m < m1; m += MR) {
                int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                tile(x + m * ldx, ldx, w + n * ldw, ldw, out + m * ldo + n, ldo, k_len, mr, nr);
            }
        }
    }
}
