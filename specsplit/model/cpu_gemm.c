/* out[m, n] = sum_k x[m, k] * w[n, k] in float32 on the CPU, each output in one fixed order
 * whatever the number of rows: lane l of a vector accumulator (16 lanes with AVX-512, 8 with
 * AVX2) sums x[m, k] * w[n, k] for k = l, l + LANES, ... by fused multiply-add in increasing k
 * (the last partial vector masked to zeros), then the lanes are added in one fixed tree. So a
 * row's result is the same bits in a batch of 1 or of 300 rows, and in any block of the tiling
 * (specsplit/model/cpu_gemm.py builds and loads this; the blocks only change which outputs are
 * computed together: MR rows x NR weight rows share each vector load).
 *
 * Packed weights (quant_gemm): rows of 32-weight blocks, each weight d * q + m (4-bit q, kind 1)
 * or d * q (8-bit signed q, kind 2) with d and m float32 (specsplit/model/cpu_quant.py packs
 * GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 so), a bfloat16 (kind 3), or d * q with a d for each 16
 * weights (8-bit signed q, kind 4: Q6_K). Each weight is formed in float32,
 * exactly its dequantized value (d * q is exact, so d * q + m rounds once, as gguf's numpy does; a
 * bfloat16 widens exactly), and summed in the same lanes and order as a float32 weight, so
 * quant_gemm gives fixed_gemm's bits on the dequantized matrix while reading 0.75 (kind 1), 1.125
 * (kind 2) or 2 (kind 3) bytes a weight, not 4.
 *
 * Threads: OpenMP over blocks of weight rows (the process's OpenMP runtime, torch's: its
 * libgomp.so.1 is the one already loaded). The threads split the weight rows, never a sum.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MR 4 /* rows of x a block */
#define NR 4 /* rows of w a block */
#define MCHUNK 256 /* rows of x a pass over the weights (each weight row read once a pass) */

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma")))
#define QBLOCK 32 /* weights a packed block */
/* bytes ahead of a packed block its line is prefetched: a thread's weight rows are one
 * contiguous run, and the hardware's prefetchers alone left a packed step latency-bound (the
 * embedded default's one-row step 11.2 ms without, 6.1 with 8192; 1024: 8.6, 4096: 6.3, 32768:
 * 7.2; bench/cpu_step.py). A prefetch past the end of the rows does not fault. */
#define PREFETCH 8192

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

/* ---------------------------------------------------------------- packed weights */

/* a packed block's weights s * LANES ... s * LANES + LANES - 1 in float32: kind 1 (4-bit: float
 * d, float m, 16 bytes whose low nibbles are weights 0-15 and high nibbles 16-31) is 24 bytes,
 * kind 2 (8-bit: float d, 32 signed bytes) 36 */
#define Q4_BYTES 24
#define Q8_BYTES 36
#define BF16_BYTES 64 /* kind 3: 32 bfloat16 weights, each exact in float32 */
#define Q6_BYTES 40 /* kind 4: float d for weights 0-15, float d for 16-31, 32 signed bytes */

AVX512 ALWAYS_INLINE __m512 q4_lanes16(const uint8_t *block, int s) {
    __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(block + 8)));
    __m512i nibbles = s == 0 ? _mm512_and_si512(bytes, _mm512_set1_epi32(15)) : _mm512_srli_epi32(bytes, 4);
    return _mm512_fmadd_ps(_mm512_set1_ps(((const float *)block)[0]), _mm512_cvtepi32_ps(nibbles),
                           _mm512_set1_ps(((const float *)block)[1]));
}

AVX512 ALWAYS_INLINE __m512 q8_lanes16(const uint8_t *block, int s) {
    __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 4 + 16 * s)));
    return _mm512_mul_ps(_mm512_set1_ps(((const float *)block)[0]), _mm512_cvtepi32_ps(q));
}

AVX2 ALWAYS_INLINE __m256 q4_lanes8(const uint8_t *block, int s) {
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 + 8 * (s & 1))));
    __m256i nibbles = s < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
    return _mm256_fmadd_ps(_mm256_set1_ps(((const float *)block)[0]), _mm256_cvtepi32_ps(nibbles),
                           _mm256_set1_ps(((const float *)block)[1]));
}

AVX2 ALWAYS_INLINE __m256 q8_lanes8(const uint8_t *block, int s) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 4 + 8 * s)));
    return _mm256_mul_ps(_mm256_set1_ps(((const float *)block)[0]), _mm256_cvtepi32_ps(q));
}

AVX512 ALWAYS_INLINE __m512 bf16_lanes16(const uint8_t *block, int s) {
    __m512i half = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(block + 32 * s)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(half, 16));
}

AVX2 ALWAYS_INLINE __m256 bf16_lanes8(const uint8_t *block, int s) {
    __m256i half = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(block + 16 * s)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(half, 16));
}

AVX512 ALWAYS_INLINE __m512 q6_lanes16(const uint8_t *block, int s) {
    __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(block + 8 + 16 * s)));
    return _mm512_mul_ps(_mm512_set1_ps(((const float *)block)[s]), _mm512_cvtepi32_ps(q));
}

AVX2 ALWAYS_INLINE __m256 q6_lanes8(const uint8_t *block, int s) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block + 8 + 8 * s)));
    return _mm256_mul_ps(_mm256_set1_ps(((const float *)block)[s >> 1]), _mm256_cvtepi32_ps(q));
}

/* block16 / block8 over packed rows: per block (the line PREFETCH bytes ahead of it prefetched),
 * LANES weights of each of the nr rows formed (DEQUANT) and multiplied into the accumulators in
 * increasing k, as the float32 blocks do */
#define PACKED_BLOCK(NAME, TARGET, VEC, LANES, ZERO, LOAD, FMA, HSUM, DEQUANT, BYTES)         \
    TARGET ALWAYS_INLINE void NAME(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw,  \
                                   float *out, int64_t ldo, int64_t k_len, const int mr,        \
                                   const int nr) {                                              \
        VEC acc[MR][NR];                                                                        \
        for (int i = 0; i < mr; i++)                                                            \
            for (int j = 0; j < nr; j++) acc[i][j] = ZERO();                                    \
        for (int64_t b = 0; b * QBLOCK < k_len; b++) {                                          \
            for (int j = 0; j < nr; j++)                                                        \
                _mm_prefetch((const char *)(w + j * ldw + b * BYTES + PREFETCH), _MM_HINT_T0);  \
            _Pragma("GCC unroll 4") for (int s = 0; s < QBLOCK / LANES; s++) {                 \
                VEC wv[NR];                                                                     \
                for (int j = 0; j < nr; j++) wv[j] = DEQUANT(w + j * ldw + b * BYTES, s);       \
                for (int i = 0; i < mr; i++) {                                                  \
                    VEC xv = LOAD(x + i * ldx + b * QBLOCK + s * LANES);                        \
                    for (int j = 0; j < nr; j++) acc[i][j] = FMA(xv, wv[j], acc[i][j]);         \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < mr; i++)                                                            \
            for (int j = 0; j < nr; j++) out[i * ldo + j] = HSUM(acc[i][j]);                    \
    }

PACKED_BLOCK(q4_block16, AVX512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
             hsum16, q4_lanes16, Q4_BYTES)
PACKED_BLOCK(q8_block16, AVX512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
             hsum16, q8_lanes16, Q8_BYTES)
PACKED_BLOCK(bf16_block16, AVX512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
             hsum16, bf16_lanes16, BF16_BYTES)
PACKED_BLOCK(q6_block16, AVX512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
             hsum16, q6_lanes16, Q6_BYTES)
PACKED_BLOCK(q4_block8, AVX2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps,
             hsum8, q4_lanes8, Q4_BYTES)
PACKED_BLOCK(q8_block8, AVX2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps,
             hsum8, q8_lanes8, Q8_BYTES)
PACKED_BLOCK(bf16_block8, AVX2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps,
             hsum8, bf16_lanes8, BF16_BYTES)
PACKED_BLOCK(q6_block8, AVX2, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps,
             hsum8, q6_lanes8, Q6_BYTES)

/* a packed row's k_len weights formed in float32 into dst (DEQUANT's values, the same a block
 * above multiplies), its lines prefetched PREFETCH bytes ahead */
#define PACKED_ROW(NAME, TARGET, LANES, STORE, DEQUANT, BYTES)                                  \
    TARGET static void NAME(const uint8_t *row, int64_t k_len, float *dst) {                    \
        for (int64_t b = 0; b * QBLOCK < k_len; b++) {                                          \
            _mm_prefetch((const char *)(row + b * BYTES + PREFETCH), _MM_HINT_T0);              \
            _Pragma("GCC unroll 4") for (int s = 0; s < QBLOCK / LANES; s++)                   \
                STORE(dst + b * QBLOCK + s * LANES, DEQUANT(row + b * BYTES, s));               \
        }                                                                                       \
    }

PACKED_ROW(q4_row16, AVX512, 16, _mm512_storeu_ps, q4_lanes16, Q4_BYTES)
PACKED_ROW(q8_row16, AVX512, 16, _mm512_storeu_ps, q8_lanes16, Q8_BYTES)
PACKED_ROW(bf16_row16, AVX512, 16, _mm512_storeu_ps, bf16_lanes16, BF16_BYTES)
PACKED_ROW(q6_row16, AVX512, 16, _mm512_storeu_ps, q6_lanes16, Q6_BYTES)
PACKED_ROW(q4_row8, AVX2, 8, _mm256_storeu_ps, q4_lanes8, Q4_BYTES)
PACKED_ROW(q8_row8, AVX2, 8, _mm256_storeu_ps, q8_lanes8, Q8_BYTES)
PACKED_ROW(bf16_row8, AVX2, 8, _mm256_storeu_ps, bf16_lanes8, BF16_BYTES)
PACKED_ROW(q6_row8, AVX2, 8, _mm256_storeu_ps, q6_lanes8, Q6_BYTES)

/* ---------------------------------------------------------------- the loops */

/* every (mr, nr) of 1..MR x 1..NR as its own unrolled block, so the accumulators stay in
 * registers; `BLOCK` is one of the blocks above, `W` its weight pointer's type */
#define CALL(BLOCK, MRV, NRV) BLOCK(x, ldx, (const W *)w, ldw, out, ldo, k_len, MRV, NRV)
#define BY_NR(BLOCK, MRV)                                                                  \
    switch (nr) {                                                                          \
    case 1: CALL(BLOCK, MRV, 1); break;                                                    \
    case 2: CALL(BLOCK, MRV, 2); break;                                                    \
    case 3: CALL(BLOCK, MRV, 3); break;                                                    \
    default: CALL(BLOCK, MRV, NR); break;                                                  \
    }
#define TILE(NAME, TARGET, BLOCK)                                                          \
    TARGET static void NAME(const float *x, int64_t ldx, const void *w, int64_t ldw,       \
                            float *out, int64_t ldo, int64_t k_len, int mr, int nr) {      \
        switch (mr) {                                                                      \
        case 1: BY_NR(BLOCK, 1) break;                                                     \
        case 2: BY_NR(BLOCK, 2) break;                                                     \
        case 3: BY_NR(BLOCK, 3) break;                                                     \
        default: BY_NR(BLOCK, MR) break;                                                   \
        }                                                                                  \
    }

#define W float
TILE(tile16, AVX512, block16)
TILE(tile8, AVX2, block8)
#undef W
#define W uint8_t
TILE(q4_tile16, AVX512, q4_block16)
TILE(q8_tile16, AVX512, q8_block16)
TILE(q4_tile8, AVX2, q4_block8)
TILE(q8_tile8, AVX2, q8_block8)
TILE(bf16_tile16, AVX512, bf16_block16)
TILE(bf16_tile8, AVX2, bf16_block8)
TILE(q6_tile16, AVX512, q6_block16)
TILE(q6_tile8, AVX2, q6_block8)
#undef W

/* ---------------------------------------------------------------- AMX: 8-bit x */

/* Panels (kinds 5 and 6, specsplit/model/cpu_quant.py's `panels`): a matrix's 4-bit (kind 1) or
 * 8-bit (kind 2) weights regrouped 16 rows a panel, each 32-weight block of a panel one record:
 * 16 float d, then (kind 5) 16 float m and 256 bytes whose low nibbles are AMX's tile of the
 * block's weights 0-15 (4 rows: row r, column n, byte j = weight 4r + j of the panel's row n) and
 * high nibbles weights 16-31; (kind 6) 512 signed bytes, weights 0-15's tile then 16-31's (the
 * two halves one after the other: the block's one tile of 8 rows, k / 4 each).
 *
 * int8_gemm: each row's block of 32 x is taken as two 8-bit parts (q1 = x rounded to 8 bits:
 * dx1 = max |x| / 127, q1 = x * (127 / max |x|) rounded to nearest even, llama.cpp's Q8
 * activations; q2 the same of what q1 left, x - q1 * dx1: ~15 bits in all), AMX's 8-bit dot
 * products give each part's block sum of q * weight q exactly (int32), and an output is then, in
 * float32, block by block in increasing k: acc += d * (sum1 * dx1 + sum2 * dx2) + m * c, c =
 * sum(q1) * dx1 + sum(q2) * dx2 (kind 6: no m term). Integer sums and per-element float
 * operations: the same bits alone or among any number of rows, and the same as
 * specsplit/model/cpu_quant.py's `int8_reference` in torch. Not the float32 route's bits: within
 * ~2e-5 of its products (the embedded default's logits within 4e-5-2e-4). */
#define AMX8 __attribute__((target("avx512f,avx512bw,amx-tile,amx-int8")))
#define AVX512BW __attribute__((target("avx512f,avx512bw")))
#define VNNI8 __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PANEL_ROWS 16
#define Q4P_BYTES 384 /* a kind-5 record: 64 bytes of d, 64 of m, 256 of nibbles */
#define Q8P_BYTES 576 /* a kind-6 record: 64 bytes of d, 512 signed bytes */

/* Half-scale panels (kinds 7 and 8, vnni_gemm's only): kind 5's and 6's records with each d and
 * m as float16 (exact: cpu_quant.panels makes them only where every scale is a float16, as a
 * GGUF Q4_0 / Q4_1 / Q8_0 block's are), so a record is 320 (7) or 544 (8) bytes where it was 384
 * or 576; widened to float32 exactly, they give kinds 5's and 6's bits. A one-row step streams
 * its weights at the memory's rate: the embedded default's 4-bit layers read 67 MB a step
 * instead of 80. */
#define Q4H_BYTES 320 /* a kind-7 record: 32 bytes of d, 32 of m, 256 of nibbles */
#define Q8H_BYTES 544 /* a kind-8 record: 32 bytes of d, 512 signed bytes */
ALWAYS_INLINE int four_bit_kind(int kind) { return kind == 5 || kind == 7; }
ALWAYS_INLINE int64_t record_bytes(int kind) {
    return kind == 5 ? Q4P_BYTES : kind == 6 ? Q8P_BYTES : kind == 7 ? Q4H_BYTES : Q8H_BYTES;
}
/* bytes of d (and m) at a record's start: the weights follow */
ALWAYS_INLINE int64_t scale_bytes(int kind) { return kind == 5 ? 128 : kind == 8 ? 32 : 64; }

/* a record's 16 d and 16 m (kinds 6 and 8: m unread) in float32 */
AVX512BW ALWAYS_INLINE void record_scales(const uint8_t *record, int kind, __m512 *d, __m512 *mins) {
    if (kind >= 7) {
        *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)record));
        *mins = kind == 7 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 32))) : *d;
    } else {
        *d = _mm512_loadu_ps((const float *)record);
        *mins = _mm512_loadu_ps((const float *)(record + 64));
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Whether this CPU has AMX's 8-bit tiles and the kernel granted this process their state
 * (asked once; panels are made only where it says 1). */
int amx_int8_ready(void) {
    static int ready = -1;
    if (ready >= 0) return ready;
    unsigned a, b, c, d;
    ready = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return ready;
    int tiles = (d >> 24) & 1, int8_tiles = (d >> 25) & 1;
    __builtin_cpu_init();
    ready = tiles && int8_tiles && __builtin_cpu_supports("avx512bw") &&
            syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* a row's block of 32 x (v0, v1) -> its 8-bit q (into q, 32 bytes), its scale (dx = max |v| /
 * 127) and the sum of its q (sx, in float); q's values in float32 into *f0, *f1 */
AVX512BW ALWAYS_INLINE void int8_block(__m512 v0, __m512 v1, int8_t *q, float *dx, float *sx, __m512 *f0,
                                   __m512 *f1) {
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    float inverse = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
    _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(q1));
    *dx = amax / 127.0f;
    *sx = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    *f0 = _mm512_cvtepi32_ps(q0);
    *f1 = _mm512_cvtepi32_ps(q1);
}

/* rows of x -> two 8-bit parts a block of 32 (part 1: x rounded to 8 bits; part 2: what part 1
 * left, x - q1 * dx1, rounded to 8 bits): xq [m_pad / tile][2][tile][k_len] (a tile of x's rows,
 * each part's q of them: the 2 * tile rows of one tile operand) and dx [2][m_pad][k_len / 32]
 * (each part's scale), and c [m_pad][k_len / 32] = sum(q1) * dx1 + sum(q2) * dx2 (the block's x
 * as the parts give it, summed: what a 4-bit block's m multiplies); rows past m_len zeros */
AVX512BW static void int8_rows(const float *x, int64_t ldx, int64_t m_len, int64_t m_pad, int64_t tile,
                               int64_t k_len, int8_t *xq, float *dx, float *c) {
    int64_t blocks = k_len / QBLOCK;
    memset(xq, 0, (size_t)(2 * m_pad * k_len));
    memset(dx, 0, (size_t)(2 * m_pad * blocks) * sizeof(float));
    memset(c, 0, (size_t)(m_pad * blocks) * sizeof(float));
    int64_t part_q = tile * k_len, part_s = m_pad * blocks;
    for (int64_t m = 0; m < m_len; m++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *v = x + m * ldx + b * QBLOCK;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), f0, f1;
            int64_t at = ((m / tile) * 2 * tile + m % tile) * k_len + b * QBLOCK, s = m * blocks + b;
            float sx1, sx2;
            int8_block(v0, v1, xq + at, dx + s, &sx1, &f0, &f1);
            __m512 scale = _mm512_set1_ps(dx[s]);
            __m512 r0 = _mm512_sub_ps(v0, _mm512_mul_ps(f0, scale));
            __m512 r1 = _mm512_sub_ps(v1, _mm512_mul_ps(f1, scale));
            int8_block(r0, r1, xq + part_q + at, dx + part_s + s, &sx2, &f0, &f1);
            c[s] = sx1 * dx[s] + sx2 * dx[part_s + s];
        }
}

/* x's two 8-bit parts (int8_rows' layout, `tile` rows a tile operand, m_pad rows) in buffers of
 * their own, for int8_gemm and vnni_gemm; int8_free releases them */
typedef struct {
    int8_t *xq;
    float *dx, *c;
} Int8X;

AVX512BW static Int8X int8_x(const float *x, int64_t ldx, int64_t m_len, int64_t m_pad, int64_t tile,
                             int64_t k_len) {
    int64_t blocks = k_len / QBLOCK;
    Int8X parts = {aligned_alloc(64, (size_t)((2 * m_pad * k_len + 63) / 64 * 64)),
                   aligned_alloc(64, (size_t)((2 * m_pad * blocks * 4 + 63) / 64 * 64)),
                   aligned_alloc(64, (size_t)((m_pad * blocks * 4 + 63) / 64 * 64))};
    if (!parts.xq || !parts.dx || !parts.c) abort();
    int8_rows(x, ldx, m_len, m_pad, tile, k_len, parts.xq, parts.dx, parts.c);
    return parts;
}

static void int8_free(Int8X parts) {
    free(parts.xq);
    free(parts.dx);
    free(parts.c);
}

/* a kind-5 record's 256 bytes of nibbles -> tiles[0] (the low nibbles: weights 0-15's tile) and
 * tiles[1] (the high: 16-31's) */
AMX8 ALWAYS_INLINE void int8_split(const uint8_t *nibbles, uint8_t (*tiles)[4][64], __m512i low) {
    for (int r = 0; r < 4; r++) {
        __m512i v = _mm512_loadu_si512(nibbles + 64 * r);
        _mm512_store_si512(tiles[0][r], _mm512_and_si512(v, low));
        _mm512_store_si512(tiles[1][r], _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    }
}

/* a block's sums (a tile stored to sums: [part][x rows][16 weight rows]) scaled into acc, the
 * module's comment: acc[i] += d * (s1 * dx1 + s2 * dx2) (+ m * c, kinds 5 and 7) */
AVX512BW ALWAYS_INLINE void int8_scale(__m512 *acc, int32_t (*sums)[PANEL_ROWS], const uint8_t *record,
                                   const float *dxb, const float *cb, int64_t part_s, int64_t blocks,
                                   int mr, int64_t tile_rows, int kind) {
    __m512 d, mins;
    record_scales(record, kind, &d, &mins);
    for (int i = 0; i < mr; i++) {
        __m512 e = _mm512_add_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i])), _mm512_set1_ps(dxb[i * blocks])),
            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[tile_rows + i])),
                          _mm512_set1_ps(dxb[part_s + i * blocks])));
        __m512 t = _mm512_mul_ps(d, e);
        if (four_bit_kind(kind)) t = _mm512_add_ps(t, _mm512_mul_ps(mins, _mm512_set1_ps(cb[i * blocks])));
        acc[i] = _mm512_add_ps(acc[i], t);
    }
}

/* out [m_len, n_len] from panels w (`kind` 5 or 6, ldw bytes a panel), the module's comment:
 * OpenMP over pairs of panels, each pair's records read once for every 8 rows of x. A block is
 * one 8-bit dot product a panel (x's 32 bytes a row in tile 2, the block's weights as 8 rows of
 * k / 4 in tile 3 or 4, the sums in tile 0 or 1), the pair's two chains interleaved op by op so
 * that one's store and scaling overlap the other's (one panel at a time, the embedded default's
 * layers' one-row products took 1.04-1.08x the float32 route's time, a pair 0.87-0.90x, three
 * at a time 1.0-1.06x) */
AMX8 static void int8_gemm(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int kind,
                           float *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len,
                           int threads) {
    if (m_len == 0) return;
    /* x's rows a tile: both parts of each in one tile operand of at most 16 rows */
    int64_t blocks = k_len / QBLOCK, tile_rows = m_len < PANEL_ROWS / 2 ? m_len : PANEL_ROWS / 2;
    int64_t m_pad = (m_len + tile_rows - 1) / tile_rows * tile_rows;
    Int8X parts = int8_x(x, ldx, m_len, m_pad, tile_rows, k_len);
    const int8_t *xq = parts.xq;
    const float *dx = parts.dx, *c = parts.c;
    int64_t n_panels = (n_len + PANEL_ROWS - 1) / PANEL_ROWS, bytes = record_bytes(kind);
    int64_t n_pairs = (n_panels + 1) / 2;
#pragma omp parallel num_threads(threads)
    {
        TileConfig config;
        memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t <= 1; t++) { /* the sums [part][x rows][16 weight rows] */
            config.rows[t] = (uint8_t)(2 * tile_rows);
            config.colsb[t] = 64;
        }
        config.rows[2] = (uint8_t)(2 * tile_rows); /* x's bytes [part][x rows], a block's 32 k */
        config.colsb[2] = 32;
        for (int t = 3; t <= 4; t++) { /* a block's weights: 8 rows (k / 4) of 16 x 4 bytes */
            config.rows[t] = 8;
            config.colsb[t] = 64;
        }
        _tile_loadconfig(&config);
        /* [panel][block parity][weights 0-15's tile, 16-31's][tile row][bytes] */
        uint8_t nibbles[2][2][2][4][64] __attribute__((aligned(64)));
        int32_t sums[2][PANEL_ROWS][PANEL_ROWS] __attribute__((aligned(64)));
        int64_t part_s = m_pad * blocks;
        __m512i low = _mm512_set1_epi8(15);
        /* past one tile of x's rows, each pair's nibbles split once for all its blocks
         * [block][panel][weights 0-15's tile, 16-31's][tile row][bytes], not once a tile of x
         * (the same tiles; the embedded default's 256 / 1,000-token prefills 0.93-0.96x,
         * bench/cpu_prefill.py) */
        int whole = kind == 5 && m_len > tile_rows;
        uint8_t(*split)[2][2][4][64] = whole ? aligned_alloc(64, (size_t)blocks * sizeof *split) : NULL;
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < n_pairs; pair++) {
            const uint8_t *panel = w + 2 * pair * ldw, *second = panel + ldw;
            int64_t n = 2 * pair * PANEL_ROWS;
            int two = 2 * pair + 1 < n_panels; /* the pair's second panel there */
            for (int64_t b = 0; whole && b < blocks; b++) {
                int8_split(panel + b * bytes + 128, split[b][0], low);
                if (two) int8_split(second + b * bytes + 128, split[b][1], low);
            }
            for (int64_t m0 = 0; m0 < m_len; m0 += tile_rows) {
                int mr = m_len - m0 < tile_rows ? (int)(m_len - m0) : (int)tile_rows;
                __m512 acc[2][PANEL_ROWS / 2];
                for (int i = 0; i < mr; i++) acc[0][i] = acc[1][i] = _mm512_setzero_ps();
                const int8_t *xrows = xq + 2 * m0 * k_len;
                const float *dxm = dx + m0 * blocks, *cm = c + m0 * blocks;
                for (int64_t b = 0; b < blocks; b++) {
                    const uint8_t *record = panel + b * bytes, *record2 = second + b * bytes;
                    for (int64_t line = 0; line < bytes; line += 64) {
                        _mm_prefetch((const char *)(record + line + PREFETCH), _MM_HINT_T0);
                        if (two) _mm_prefetch((const char *)(record2 + line + PREFETCH), _MM_HINT_T0);
                    }
                    const void *w0 = record + 64, *w1 = record2 + 64;
                    if (whole) {
                        w0 = split[b][0];
                        w1 = split[b][1];
                    } else if (kind == 5) {
                        /* this block's nibbles were split a block ahead (their stores done before
                         * the tile loads read them); split the next block's now */
                        if (b == 0) {
                            int8_split(record + 128, nibbles[0][0], low);
                            if (two) int8_split(record2 + 128, nibbles[1][0], low);
                        }
                        if (b + 1 < blocks) {
                            int8_split(record + bytes + 128, nibbles[0][(b + 1) & 1], low);
                            if (two) int8_split(record2 + bytes + 128, nibbles[1][(b + 1) & 1], low);
                        }
                        w0 = nibbles[0][b & 1];
                        w1 = nibbles[1][b & 1];
                    }
                    _tile_zero(0);
                    if (two) _tile_zero(1);
                    _tile_loadd(2, xrows + b * QBLOCK, k_len);
                    _tile_loadd(3, w0, 64);
                    if (two) _tile_loadd(4, w1, 64);
                    if (kind == 5) {
                        _tile_dpbsud(0, 2, 3);
                        if (two) _tile_dpbsud(1, 2, 4);
                    } else {
                        _tile_dpbssd(0, 2, 3);
                        if (two) _tile_dpbssd(1, 2, 4);
                    }
                    _tile_stored(0, sums[0], 64);
                    if (two) _tile_stored(1, sums[1], 64);
                    int8_scale(acc[0], sums[0], record, dxm + b, cm + b, part_s, blocks, mr, tile_rows, kind);
                    if (two)
                        int8_scale(acc[1], sums[1], record2, dxm + b, cm + b, part_s, blocks, mr, tile_rows,
                                   kind);
                }
                for (int half = 0; half <= two; half++) {
                    int64_t n0 = n + half * PANEL_ROWS;
                    int nr = n_len - n0 < PANEL_ROWS ? (int)(n_len - n0) : PANEL_ROWS;
                    __mmask16 mask = (__mmask16)((1u << nr) - 1);
                    for (int i = 0; i < mr; i++)
                        _mm512_mask_storeu_ps(out + (m0 + i) * ldo + n0, mask, acc[half][i]);
                }
            }
        }
        _tile_release();
        free(split);
    }
    int8_free(parts);
}

/* Whether this CPU has AVX-512 VNNI (and BW): int8 products without AMX, the same sums */
int vnni_int8_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        __builtin_cpu_init();
        ready = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
    }
    return ready;
}

/* rows of x from which a product on panels takes AMX's tiles where the CPU has both (fewer go
 * to vnni_gemm): all, since on the development VM's Xeon the two tie at 1-2 rows and AMX is the
 * faster from 4 (the embedded default's layers, bench/cpu_int8_gemm.py: 0.76-0.83x against
 * 0.82-0.88x the float32 route's time at 4 rows, 0.64-0.68x against 0.85-0.91x at 8).
 * `int8_kernel_rows` sets it and returns what it was (tests: each kernel at every row count). */
#define AMX_FROM_ROWS 1
static int64_t amx_from_rows = AMX_FROM_ROWS;

/* *at = value; returns what *at was (the settings tests change and restore) */
int64_t swap_setting(int64_t *at, int64_t value) {
    int64_t was = *at;
    *at = value;
    return was;
}

int64_t int8_kernel_rows(int64_t rows) { return swap_setting(&amx_from_rows, rows); }

#define VNNI_ROWS 4 /* rows of x a pass over a panel's block (its weights kept in registers) */
typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;

/* int8_gemm's product with AVX-512 VNNI instead of AMX: the same exact int32 block sums
 * (`vpdpbusd`: a record's 8 tile rows, k / 4 each, are 16 weight rows' 4 bytes a lane, times x's
 * 4 bytes broadcast; kind 6's signed weights take x + 128 unsigned and give back 128 times the
 * weights' sum), then int8_scale's float32 operations in its order: the same bits as int8_gemm
 * and `int8_reference`. Each part's sums land in registers (no tile store), so few rows are
 * cheaper here than on AMX's tiles. */
VNNI8 static void vnni_gemm(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int kind,
                            float *out, int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len,
                            int threads) {
    if (m_len == 0) return;
    int64_t blocks = k_len / QBLOCK;
    /* x's parts a row: xq [m][2][k_len], dx [2][m][blocks], c [m][blocks] */
    Int8X parts = int8_x(x, ldx, m_len, m_len, 1, k_len);
    const int8_t *xq = parts.xq;
    const float *dx = parts.dx, *c = parts.c;
    int64_t n_panels = (n_len + PANEL_ROWS - 1) / PANEL_ROWS, bytes = record_bytes(kind);
    int64_t part_s = m_len * blocks, weights_at = scale_bytes(kind);
    int four = four_bit_kind(kind);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < n_panels; p++) {
        const uint8_t *panel = w + p * ldw;
        int64_t n = p * PANEL_ROWS;
        int nr = n_len - n < PANEL_ROWS ? (int)(n_len - n) : PANEL_ROWS;
        __m512i low = _mm512_set1_epi8(15), ones = _mm512_set1_epi8(1);
        __m512i flip = _mm512_set1_epi32((int)0x80808080u);
        for (int64_t m0 = 0; m0 < m_len; m0 += VNNI_ROWS) {
            int mr = m_len - m0 < VNNI_ROWS ? (int)(m_len - m0) : VNNI_ROWS;
            __m512 acc[VNNI_ROWS];
            for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                const uint8_t *record = panel + b * bytes;
                for (int64_t line = 0; line < bytes; line += 64)
                    _mm_prefetch((const char *)(record + line + PREFETCH), _MM_HINT_T0);
                /* the block's tile rows: row r holds k 4r..4r+3 of the 16 weight rows */
                __m512i rows[8], shift = _mm512_setzero_si512();
                if (four) {
                    for (int r = 0; r < 4; r++) {
                        __m512i v = _mm512_loadu_si512(record + weights_at + 64 * r);
                        rows[r] = _mm512_and_si512(v, low);
                        rows[4 + r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    }
                } else {
                    for (int r = 0; r < 8; r++) {
                        rows[r] = _mm512_loadu_si512(record + weights_at + 64 * r);
                        shift = _mm512_dpbusd_epi32(shift, ones, rows[r]);
                    }
                    shift = _mm512_slli_epi32(shift, 7); /* 128 times each weight row's sum */
                }
                for (int i = 0; i < mr; i++) {
                    const int8_t *x1 = xq + 2 * (m0 + i) * k_len + b * QBLOCK, *x2 = x1 + k_len;
                    __m512i s[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                                    _mm512_setzero_si512()};
                    for (int r = 0; r < 8; r++) {
                        /* x's 4 bytes at k 4r, read as one int32 (broadcast from memory) */
                        int32_t q1 = ((const unaligned_i32 *)x1)[r], q2 = ((const unaligned_i32 *)x2)[r];
                        if (four) {
                            s[r & 1] = _mm512_dpbusd_epi32(s[r & 1], rows[r], _mm512_set1_epi32(q1));
                            s[2 + (r & 1)] = _mm512_dpbusd_epi32(s[2 + (r & 1)], rows[r], _mm512_set1_epi32(q2));
                        } else {
                            __m512i u1 = _mm512_xor_si512(_mm512_set1_epi32(q1), flip);
                            __m512i u2 = _mm512_xor_si512(_mm512_set1_epi32(q2), flip);
                            s[r & 1] = _mm512_dpbusd_epi32(s[r & 1], u1, rows[r]);
                            s[2 + (r & 1)] = _mm512_dpbusd_epi32(s[2 + (r & 1)], u2, rows[r]);
                        }
                    }
                    int32_t sums[2][PANEL_ROWS] __attribute__((aligned(64)));
                    _mm512_store_si512(sums[0], _mm512_sub_epi32(_mm512_add_epi32(s[0], s[1]), shift));
                    _mm512_store_si512(sums[1], _mm512_sub_epi32(_mm512_add_epi32(s[2], s[3]), shift));
                    const float *dxb = dx + (m0 + i) * blocks + b, *cb = c + (m0 + i) * blocks + b;
                    int8_scale(acc + i, sums, record, dxb, cb, part_s, blocks, 1, 1, kind);
                }
            }
            __mmask16 mask = (__mmask16)((1u << nr) - 1);
            for (int i = 0; i < mr; i++) _mm512_mask_storeu_ps(out + (m0 + i) * ldo + n, mask, acc[i]);
        }
    }
    int8_free(parts);
}

/* (x rows, their stride, weight rows, their stride in the weights' elements, ...) */
typedef void (*tile_fn)(const float *, int64_t, const void *, int64_t, float *, int64_t,
                        int64_t, int, int);
/* (a packed row, k_len, where its weights go in float32) */
typedef void (*row_fn)(const uint8_t *, int64_t, float *);

/* The lanes this CPU's kernel uses: 16 (AVX-512), 8 (AVX2 + FMA) or 0 (neither: not usable). */
int fixed_gemm_lanes(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
    return 0;
}

/* out [m_len, n_len] by `tile` over weight rows of `row_bytes` bytes from w (ldw: the stride
 * the tile reads them with), MCHUNK rows of x a pass, OpenMP over blocks of NR weight rows.
 * `form` (packed rows, else NULL): each block's NR rows formed once a pass into the thread's
 * float32 buffer, which the tile (fixed_gemm's) then reads: the same products in the same order
 * as the packed blocks, which form each weight again for every MR rows of x */
static void run_tiles(tile_fn tile, row_fn form, const float *x, int64_t ldx, const uint8_t *w,
                      int64_t ldw, int64_t row_bytes, float *out, int64_t ldo, int64_t m_len,
                      int64_t n_len, int64_t k_len, int threads) {
    int64_t n_blocks = (n_len + NR - 1) / NR;
    size_t formed_bytes = (size_t)((NR * k_len * (int64_t)sizeof(float) + 63) / 64 * 64);
    for (int64_t m0 = 0; m0 < m_len; m0 += MCHUNK) {
        int64_t m1 = m0 + MCHUNK < m_len ? m0 + MCHUNK : m_len;
#pragma omp parallel num_threads(threads)
        {
            float *formed = form ? aligned_alloc(64, formed_bytes) : NULL;
            if (form && !formed) abort();
#pragma omp for schedule(static)
            for (int64_t nb = 0; nb < n_blocks; nb++) {
                int64_t n = nb * NR;
                int nr = n_len - n < NR ? (int)(n_len - n) : NR;
                const void *rows = w + n * row_bytes;
                int64_t ld = ldw;
                if (form) {
                    for (int j = 0; j < nr; j++) form(w + (n + j) * row_bytes, k_len, formed + j * k_len);
                    rows = formed;
                    ld = k_len;
                }
                for (int64_t m = m0; m < m1; m += MR) {
                    int mr = m1 - m < MR ? (int)(m1 - m) : MR;
                    tile(x + m * ldx, ldx, rows, ld, out + m * ldo + n, ldo, k_len, mr, nr);
                }
            }
            free(formed);
        }
    }
}

/* x [m_len, k_len] (row stride ldx), w [n_len, k_len] (row stride ldw) -> out [m_len, n_len]
 * (row stride ldo), with `lanes` from fixed_gemm_lanes() (or 8 where it said 16), on `threads`
 * threads (torch's count: OpenMP's per-thread setting is not the engine thread's). */
void fixed_gemm(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out, int64_t ldo,
                int64_t m_len, int64_t n_len, int64_t k_len, int lanes, int threads) {
    run_tiles(lanes == 16 ? tile16 : tile8, NULL, x, ldx, (const uint8_t *)w, ldw,
              ldw * (int64_t)sizeof(float), out, ldo, m_len, n_len, k_len, threads);
}

/* fixed_gemm with packed weights: w [n_len, k_len / 32 blocks of `kind`] (row stride ldw
 * bytes), k_len a multiple of 32; up to MR rows of x straight from the packed blocks, more
 * from the rows formed once a pass (run_tiles' `form`; the same bits either way) */
void quant_gemm(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int kind, float *out,
                int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int lanes, int threads) {
    if (kind >= 5) { /* panels: made only where amx_int8_ready or vnni_int8_ready (7, 8: VNNI) */
        if (kind <= 6 && amx_int8_ready() && (m_len >= amx_from_rows || !vnni_int8_ready()))
            int8_gemm(x, ldx, w, ldw, kind, out, ldo, m_len, n_len, k_len, threads);
        else
            vnni_gemm(x, ldx, w, ldw, kind, out, ldo, m_len, n_len, k_len, threads);
        return;
    }
    int wide = lanes == 16;
    if (m_len > MR) {
        row_fn form = kind == 1   ? (wide ? q4_row16 : q4_row8)
                      : kind == 2 ? (wide ? q8_row16 : q8_row8)
                      : kind == 3 ? (wide ? bf16_row16 : bf16_row8)
                                  : (wide ? q6_row16 : q6_row8);
        run_tiles(wide ? tile16 : tile8, form, x, ldx, w, ldw, ldw, out, ldo, m_len, n_len, k_len,
                  threads);
        return;
    }
    tile_fn tile = kind == 1   ? (wide ? q4_tile16 : q4_tile8)
                   : kind == 2 ? (wide ? q8_tile16 : q8_tile8)
                   : kind == 3 ? (wide ? bf16_tile16 : bf16_tile8)
                               : (wide ? q6_tile16 : q6_tile8);
    run_tiles(tile, NULL, x, ldx, w, ldw, ldw, out, ldo, m_len, n_len, k_len, threads);
}
