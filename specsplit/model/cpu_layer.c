/* One decoder layer of specsplit/model/llama.py in float32 on the CPU, in one call: input
 * RMSNorm, the qkv projection, q / k norms (Qwen3), RoPE, the K/V store into the paged cache,
 * attention over each row's keys, o_proj and the residual, the post-attention RMSNorm,
 * gate_up, SiLU-and-mul, down_proj and the residual. The projections are cpu_gemm.c's
 * fixed_gemm; everything else works a row (or a row and a head) at a time, so every row's
 * result is the same bits whatever the other rows of the step are (a one-token step, a verify
 * of 1 + n tokens, a prefill), and the same from packed weights (quant_gemm) as from float32
 * ones. specsplit/model/cpu_layer.py builds the arguments; the torch
 * forward it replaces (DecoderLayer.forward with the CPU's references) is its reference.
 *
 * Attention of row t, head h: scores against each visible key (its keys: num_keys[t] slots at
 * key_slots[key_start[t]...]; visible: all, or where masks[mask_start[t] + j] is nonzero), a
 * softmax over them (max, expf, sum in key order), the values summed in key order. A hidden
 * key is skipped, so a row's output does not move with keys hidden from it.
 *
 * The cache is float32, or float16 (S->kv_half: half the bytes a long context's step streams):
 * K and V rounded to float16 once, as they are stored (narrow_row), and widened back to float32
 * as each reader loads them (LOAD16H / LOAD8H) before the same float32 operations, so a row's
 * bits still do not depend on the rest of the step or the way it attends.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void fixed_gemm(const float *x, int64_t ldx, const float *w, int64_t ldw, float *out, int64_t ldo,
                int64_t m_len, int64_t n_len, int64_t k_len, int lanes, int threads);
int64_t swap_setting(int64_t *at, int64_t value); /* cpu_gemm.c's */
void quant_gemm(const float *x, int64_t ldx, const uint8_t *w, int64_t ldw, int kind, float *out,
                int64_t ldo, int64_t m_len, int64_t n_len, int64_t k_len, int lanes, int threads);

/* a run of a projection's rows packed in one kind (cpu_gemm.c's quant_gemm: the same sums) */
typedef struct {
    const uint8_t *packed;
    int64_t stride, kind, rows; /* bytes a packed row, cpu_gemm.c's kind, rows of the run */
} Run;

#define MAX_RUNS 3 /* specsplit/model/cpu_quant.py's MAX_RUNS */

/* a projection's weights [n, k]: float32, and packed where num_runs > 0 (its rows in runs) */
typedef struct {
    const float *w;
    int64_t num_runs;
    Run runs[MAX_RUNS];
} Weight;

typedef struct {
    int64_t hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps;
    const float *input_norm, *qkv_b, *q_norm, *k_norm, *o_b, *post_norm, *gate_up_b, *down_b;
    Weight qkv, o, gate_up, down;
} Layer;

typedef struct {
    int64_t num_tokens;
    const float *cos, *sin;      /* [T, head_dim] */
    const int64_t *slot_mapping; /* [T] where each row's K/V is written */
    const int64_t *key_slots;    /* the sequences' key slots, one run a sequence */
    const int64_t *key_start;    /* [T] where row t's run starts in key_slots */
    const int64_t *num_keys;     /* [T] its length */
    const uint8_t *masks;        /* visibility rows, or NULL */
    const int64_t *mask_start;   /* [T] row t's visibility row in masks, -1: every key */
    int64_t max_keys;            /* >= every num_keys */
    int64_t kv_slot_stride;      /* elements from a slot's K (or V) to the next slot's, a head */
    int64_t kv_head_stride;      /* elements from a KV head's K (or V) to the next head's, a slot */
    float scale;
    int lanes, threads;
    int kv_half;    /* the cache float16 (uint16_t elements; the strides count elements) */
    float *scratch; /* layer_scratch_floats(...) floats */
} Step;

#define AVX512 __attribute__((target("avx512f")))
#define AVX2 __attribute__((target("avx2,fma,f16c"))) /* every AVX2 CPU has F16C */
#define ALWAYS_INLINE __attribute__((always_inline)) inline

/* ---------------------------------------------------------------- a row's dot and axpy */

AVX512 static float dot16(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + i), _mm512_maskz_loadu_ps(mask, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

AVX512 static void axpy16(float *y, float p, const float *x, int64_t n) {
    __m512 pv = _mm512_set1_ps(p);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(p, x[i], y[i]);
}

/* 8 lanes summed in dot8's tree */
static inline float tree8(const float l[8]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

AVX2 static float dot8(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int64_t j = 0; i + j < n; j++) lanes[j] = fmaf(a[i + j], b[i + j], lanes[j]);
    return tree8(lanes);
}

AVX2 static void axpy8(float *y, float p, const float *x, int64_t n) {
    __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(p, x[i], y[i]);
}

/* ---------------------------------------------------------------- a float16 cache */

/* out[i] = src[i] (float16) as float32, i < n (exact) */
AVX2 static void widen8(float *out, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) out[i] = _cvtsh_ss(src[i]);
}

AVX512 static void widen16(float *out, const uint16_t *src, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    widen8(out + i, src + i, n - i);
}

/* dst[i] = src[i] rounded to float16 (to nearest, ties to even: torch's .to(torch.float16)) */
AVX2 static void narrow_row(uint16_t *dst, const float *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

/* 16 (8) lanes of a float32 or a float16 cache from element `at` of `base`, as float32 */
#define LOAD16(base, at) _mm512_loadu_ps((const float *)(base) + (at))
#define LOAD16H(base, at) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)(base) + (at))))
#define LOAD8(base, at) _mm256_loadu_ps((const float *)(base) + (at))
#define LOAD8H(base, at) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)(base) + (at))))

/* a KV head's keys (or values) as the attention's readers take them: key j's row from element
 * slots[j] * stride of base, float16 where `half` (widened as it is loaded, LOAD16H / LOAD8H) */
typedef struct {
    const void *base;
    const int64_t *slots;
    int64_t stride;
    int half;
} Rows;

/* the keys (or values) at slots[0 ..] of a layer's K (or V) cache from its element `offset` (a
 * KV head's first, and lanes into it), float32 or float16 (S->kv_half) */
static Rows kv_rows(const Step *S, const void *cache, int64_t offset, const int64_t *slots) {
    const void *head = S->kv_half ? (const void *)((const uint16_t *)cache + offset)
                                  : (const void *)((const float *)cache + offset);
    return (Rows){head, slots, S->kv_slot_stride, S->kv_half};
}

/* key j's row [width] of `rows` as float32: the cache's own, or widened into buf */
static const float *kv_row(Rows rows, int64_t j, int64_t width, int lanes, float *buf) {
    int64_t at = rows.slots[j] * rows.stride;
    if (!rows.half) return (const float *)rows.base + at;
    if (lanes == 16)
        widen16(buf, (const uint16_t *)rows.base + at, width);
    else
        widen8(buf, (const uint16_t *)rows.base + at, width);
    return buf;
}

/* ---------------------------------------------------------------- rows */

/* out = weight * (x * rsqrt(mean(x^2) + eps)), the mean summed in double */
static void rms_norm_row(float *out, const float *x, const float *weight, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)x[i] * (double)x[i];
    float rstd = 1.0f / sqrtf((float)(sum / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * rstd);
}

/* x [head_dim] rotated in place: x * cos + rotate_half(x) * sin */
static void rope_row(float *x, const float *cos, const float *sin, int64_t head_dim) {
    int64_t half = head_dim / 2;
    float rotated[512];
    for (int64_t i = 0; i < half; i++) {
        rotated[i] = -x[half + i];
        rotated[half + i] = x[i];
    }
    for (int64_t i = 0; i < head_dim; i++) x[i] = x[i] * cos[i] + rotated[i] * sin[i];
}

static void add_bias(float *rows, const float *bias, int64_t num_rows, int64_t n) {
    if (!bias) return;
    for (int64_t t = 0; t < num_rows; t++)
        for (int64_t i = 0; i < n; i++) rows[t * n + i] += bias[i];
}

/* e^x in each lane (a softmax's weights, x <= 0; SiLU's e^-gate): 2^n * e^r, n = round(x *
 * log2(e)), r = x - n * ln(2) in two parts, e^r by Cephes' expf polynomial (within ~1 ulp of
 * expf), 2^n applied by scalef (exact, subnormals included); below -104 every float's e^x is 0,
 * past ~88.7 it is inf, as expf's. Each lane alone, so a key's weight does not depend on where in
 * a block of 16 it falls. */
AVX512 static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}

/* exp16's e^x with AVX2 (8 lanes): its operations in order, 2^n as two factors 2^(n >> 1) and
 * 2^(n - (n >> 1)) (each a normal float's exponent for n in [-150, 128]; the first product is
 * exact, so one rounding, as scalef's), x at most 89 (e^x inf past ~88.7 either way): the bits
 * of exp16's lanes */
AVX2 static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1), bias = _mm256_set1_epi32(127);
    __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 high = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, low), high);
}

/* out[i] = e^(x[i] - shift) for i < n, by exp8 (8 at a time, the tail through a buffer) */
AVX2 static void exp8_n(float *out, const float *x, int64_t n, float shift) {
    __m256 s = _mm256_set1_ps(shift);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, x + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), s)));
        memcpy(out + i, tail, (size_t)(n - i) * sizeof(float));
    }
}

/* exp8's bits against exp16's over `count` floats from `start` by `step` (tests: 0) */
AVX512 int64_t layer_exp8_mismatches(float start, float step, int64_t count) {
    int64_t mismatches = 0;
    for (int64_t i = 0; i < count; i += 16) {
        float x[16], want[16], got[16];
        for (int l = 0; l < 16; l++) x[l] = start + (float)(i + l) * step;
        _mm512_storeu_ps(want, exp16(_mm512_loadu_ps(x)));
        exp8_n(got, x, 16, 0.0f);
        for (int l = 0; l < 16 && i + l < count; l++) mismatches += memcmp(&got[l], &want[l], sizeof(float)) != 0;
    }
    return mismatches;
}

/* the tests' next pseudo-random float (xorshift32; values over 40 binades) */
static float pseudo_random(uint32_t *state) {
    *state ^= *state << 13, *state ^= *state >> 17, *state ^= *state << 5;
    return ldexpf((float)(int32_t)*state / 2147483648.0f, (int)(*state % 40) - 20);
}

/* where sums16 takes key i's vector (a 4 x 4 transpose: its own inverse) */
static const int SUMS16_SLOT[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

/* the sums of 16 vectors' lanes, key i's vector at a[SUMS16_SLOT[i]], lane i of the result key
 * i's: its lanes summed in _mm512_reduce_add_ps's tree (l + l+8, then + l+4, + l+2, + l+1), the
 * same for every key, so a key's score does not depend on where in a block of 16 it falls. Four
 * rounds of vector pairs, each two shuffles and an add: 128-bit blocks across the vector
 * (shuffle_f32x4) for the first two, lanes within each block (shuffle_ps) for the last two,
 * which leaves the keys in SUMS16_SLOT's order. (Two-source permutes in each round, keys in
 * order: the same bits, 82 against 60 cycles a call on Zen 4.) */
AVX512 static inline __m512 sums16(__m512 a[16]) {
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(a[0], a[1], 0x88), _mm512_shuffle_ps(a[0], a[1], 0xDD));
}

/* blocks of 16 vectors, of `blocks` pseudo-random ones (a fixed sequence, values over 40
 * binades), where a lane of sums16 differs from _mm512_reduce_add_ps of its key's vector (the
 * bits dot16 gives; tests: 0) */
AVX512 int64_t layer_sums16_mismatches(int64_t blocks) {
    uint32_t state = 2463534242u;
    int64_t mismatches = 0;
    for (int64_t b = 0; b < blocks; b++) {
        float values[16][16], got[16];
        __m512 a[16];
        for (int i = 0; i < 16; i++)
            for (int l = 0; l < 16; l++) values[i][l] = pseudo_random(&state);
        for (int i = 0; i < 16; i++) a[SUMS16_SLOT[i]] = _mm512_loadu_ps(values[i]);
        _mm512_storeu_ps(got, sums16(a));
        for (int i = 0; i < 16; i++) {
            float want = _mm512_reduce_add_ps(_mm512_loadu_ps(values[i]));
            mismatches += memcmp(&got[i], &want, sizeof(float)) != 0;
        }
    }
    return mismatches;
}

/* scores[j] = (q . k_j) * scale for j < n, 16 keys at a time: dot16's products in its order and
 * its lane sums (sums16), so the same bits; returns the largest over the visible keys (scores of
 * hidden keys are written but never read); keys: the cache's first slot at this head */
#define SCORES16(NAME, CHUNKS, LOAD)                                                               \
    AVX512 static float NAME(float *scores, const float *q, const uint8_t *visible,               \
                             const int64_t *slots, int64_t n, const void *keys,                    \
                             int64_t slot_stride, float scale) {                                   \
        __m512 qv[CHUNKS];                                                                         \
        for (int c = 0; c < CHUNKS; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);                      \
        __m512 top = _mm512_set1_ps(-INFINITY), scale_v = _mm512_set1_ps(scale);                   \
        for (int64_t j0 = 0; j0 < n; j0 += 16) {                                                   \
            int m = n - j0 < 16 ? (int)(n - j0) : 16;                                              \
            __m512 a[16];                                                                          \
            for (int i = 0; i < 16; i++) {                                                         \
                __m512 sum = _mm512_setzero_ps();                                                  \
                if (i < m) {                                                                       \
                    int64_t at = slots[j0 + i] * slot_stride;                                      \
                    for (int c = 0; c < CHUNKS; c++)                                               \
                        sum = _mm512_fmadd_ps(qv[c], LOAD(keys, at + 16 * c), sum);                \
                }                                                                                  \
                a[SUMS16_SLOT[i]] = sum;                                                           \
            }                                                                                      \
            __m512 s = _mm512_mul_ps(sums16(a), scale_v);                                          \
            __mmask16 written = (__mmask16)(m == 16 ? 0xFFFF : (1u << m) - 1), live = written;     \
            if (visible)                                                                           \
                for (int i = 0; i < m; i++)                                                        \
                    if (!visible[j0 + i]) live &= (__mmask16)~(1u << i);                           \
            _mm512_mask_storeu_ps(scores + j0, written, s);                                        \
            top = _mm512_mask_max_ps(top, live, top, s);                                           \
        }                                                                                          \
        return _mm512_reduce_max_ps(top);                                                          \
    }
SCORES16(scores16_4, 4, LOAD16)
SCORES16(scores16_8, 8, LOAD16)
SCORES16(scores16h_4, 4, LOAD16H)
SCORES16(scores16h_8, 8, LOAD16H)

/* where sums8 takes key i's vector (a 2 x 4 transpose) */
static const int SUMS8_SLOT[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* sums16 with AVX2: the sums of 8 vectors' lanes, key i's vector at a[SUMS8_SLOT[i]], lane i of
 * the result key i's, each summed in dot8's tree ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 +
 * l7)): 128-bit halves across the pairs (permute2f128), then lanes within each half (shuffle_ps)
 * twice */
AVX2 static inline __m256 sums8(__m256 a[8]) {
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++)
        a[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(a[0], a[1], 0x88), _mm256_shuffle_ps(a[0], a[1], 0xDD));
}

/* blocks of 8 vectors, of `blocks` pseudo-random ones (layer_sums16_mismatches' values), where a
 * lane of sums8 differs from dot8's sum of its key's lanes (tests: 0) */
AVX2 int64_t layer_sums8_mismatches(int64_t blocks) {
    uint32_t state = 2463534242u;
    int64_t mismatches = 0;
    for (int64_t b = 0; b < blocks; b++) {
        float values[8][8], got[8];
        __m256 a[8];
        for (int i = 0; i < 8; i++)
            for (int l = 0; l < 8; l++) values[i][l] = pseudo_random(&state);
        for (int i = 0; i < 8; i++) a[SUMS8_SLOT[i]] = _mm256_loadu_ps(values[i]);
        _mm256_storeu_ps(got, sums8(a));
        for (int i = 0; i < 8; i++) {
            float want = tree8(values[i]);
            mismatches += memcmp(&got[i], &want, sizeof(float)) != 0;
        }
    }
    return mismatches;
}

/* scores16 with AVX2: scores[j] = (q . k_j) * scale for j < n, 8 keys at a time, dot8's
 * products in its order and its lane sums (sums8), so the same bits; returns the largest over
 * the visible keys (scores of hidden keys are written but never read) */
#define SCORES8(NAME, CHUNKS, LOAD)                                                                \
    AVX2 static float NAME(float *scores, const float *q, const uint8_t *visible,                  \
                           const int64_t *slots, int64_t n, const void *keys, int64_t slot_stride, \
                           float scale) {                                                          \
        __m256 qv[CHUNKS];                                                                         \
        for (int c = 0; c < CHUNKS; c++) qv[c] = _mm256_loadu_ps(q + 8 * c);                       \
        float top = -INFINITY;                                                                     \
        for (int64_t j0 = 0; j0 < n; j0 += 8) {                                                    \
            int m = n - j0 < 8 ? (int)(n - j0) : 8;                                                \
            __m256 a[8];                                                                           \
            for (int i = 0; i < 8; i++) {                                                          \
                __m256 sum = _mm256_setzero_ps();                                                  \
                if (i < m) {                                                                       \
                    int64_t at = slots[j0 + i] * slot_stride;                                      \
                    for (int c = 0; c < CHUNKS; c++)                                               \
                        sum = _mm256_fmadd_ps(qv[c], LOAD(keys, at + 8 * c), sum);                 \
                }                                                                                  \
                a[SUMS8_SLOT[i]] = sum;                                                            \
            }                                                                                      \
            float block[8];                                                                        \
            _mm256_storeu_ps(block, _mm256_mul_ps(sums8(a), _mm256_set1_ps(scale)));               \
            for (int i = 0; i < m; i++) {                                                          \
                scores[j0 + i] = block[i];                                                         \
                if ((!visible || visible[j0 + i]) && block[i] > top) top = block[i];               \
            }                                                                                      \
        }                                                                                          \
        return top;                                                                                \
    }
SCORES8(scores8_8, 8, LOAD8)
SCORES8(scores8_16, 16, LOAD8)
SCORES8(scores8h_8, 8, LOAD8H)
SCORES8(scores8h_16, 16, LOAD8H)

/* scores[j] = e^(scores[j] - top) for j < n, 16 at a time (entries of hidden keys too: unread) */
AVX512 static void softmax_weights16(float *scores, int64_t n, float top) {
    __m512 topv = _mm512_set1_ps(top);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(scores + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), topv)));
    if (j < n) {
        __mmask16 mask = (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + j), topv);
        _mm512_mask_storeu_ps(scores + j, mask, exp16(x));
    }
}

/* out [16 * CHUNKS] += the sum over the visible keys j of p[j] * v_j, and returns total plus the
 * sum of the p[j]: axpy16's operations in its order, the sums kept in registers (no store and
 * reload of out between keys), so keys in pieces (out and total carried from piece to piece) give
 * the bits of one call; values: the cache's first slot at this head */
#define WEIGH16(NAME, CHUNKS, LOAD)                                                                \
    AVX512 static float NAME(float *out, const float *p, const uint8_t *visible,                   \
                             const int64_t *slots, int64_t n, const void *values,                  \
                             int64_t slot_stride, float total) {                                   \
        __m512 acc[CHUNKS];                                                                        \
        for (int c = 0; c < CHUNKS; c++) acc[c] = _mm512_loadu_ps(out + 16 * c);                   \
        for (int64_t j = 0; j < n; j++) {                                                          \
            if (visible && !visible[j]) continue;                                                  \
            total += p[j];                                                                         \
            int64_t at = slots[j] * slot_stride;                                                   \
            __m512 pv = _mm512_set1_ps(p[j]);                                                      \
            for (int c = 0; c < CHUNKS; c++)                                                       \
                acc[c] = _mm512_fmadd_ps(pv, LOAD(values, at + 16 * c), acc[c]);                  \
        }                                                                                          \
        for (int c = 0; c < CHUNKS; c++) _mm512_storeu_ps(out + 16 * c, acc[c]);                   \
        return total;                                                                              \
    }
WEIGH16(weigh16_1, 1, LOAD16)
WEIGH16(weigh16_2, 2, LOAD16)
WEIGH16(weigh16_4, 4, LOAD16)
WEIGH16(weigh16_8, 8, LOAD16)
WEIGH16(weigh16h_1, 1, LOAD16H)
WEIGH16(weigh16h_2, 2, LOAD16H)
WEIGH16(weigh16h_4, 4, LOAD16H)
WEIGH16(weigh16h_8, 8, LOAD16H)

/* weigh16 with AVX2: out [8 * CHUNKS] += the sum over the visible keys j of p[j] * v_j, and
 * returns total plus the sum of the p[j]: axpy8's operations in its order (each lane's FMAs key
 * by key), the sums in registers rather than stored and reloaded a key (a chain through memory) */
#define WEIGH8(NAME, CHUNKS, LOAD)                                                                 \
    AVX2 static float NAME(float *out, const float *p, const uint8_t *visible,                     \
                           const int64_t *slots, int64_t n, const void *values,                    \
                           int64_t slot_stride, float total) {                                     \
        __m256 acc[CHUNKS];                                                                        \
        for (int c = 0; c < CHUNKS; c++) acc[c] = _mm256_loadu_ps(out + 8 * c);                    \
        for (int64_t j = 0; j < n; j++) {                                                          \
            if (visible && !visible[j]) continue;                                                  \
            total += p[j];                                                                         \
            int64_t at = slots[j] * slot_stride;                                                   \
            __m256 pv = _mm256_set1_ps(p[j]);                                                      \
            for (int c = 0; c < CHUNKS; c++)                                                       \
                acc[c] = _mm256_fmadd_ps(pv, LOAD(values, at + 8 * c), acc[c]);                   \
        }                                                                                          \
        for (int c = 0; c < CHUNKS; c++) _mm256_storeu_ps(out + 8 * c, acc[c]);                    \
        return total;                                                                              \
    }
WEIGH8(weigh8_8, 8, LOAD8)
WEIGH8(weigh8_16, 16, LOAD8)
WEIGH8(weigh8h_8, 8, LOAD8H)
WEIGH8(weigh8h_16, 16, LOAD8H)

/* ---------------------------------------------------------------- keys across lanes */

/* r[l] = column l of the 16 x 16 block r (row i's lane l in lane i): pairs of rows unpacked
 * within 128-bit blocks, then fours, then the 128-bit blocks across the vectors */
AVX512 static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + c]: rows 4i .. 4i + 3 of column 4b + c in block b */
        r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        __m512 u0 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x88), u1 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xDD);
        __m512 w0 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x88);
        __m512 w1 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xDD);
        t[c] = _mm512_shuffle_f32x4(u0, w0, 0x88);
        t[4 + c] = _mm512_shuffle_f32x4(u1, w1, 0x88);
        t[8 + c] = _mm512_shuffle_f32x4(u0, w0, 0xDD);
        t[12 + c] = _mm512_shuffle_f32x4(u1, w1, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* kt[16 * c + l] = lane l of chunk c (16 floats) of the keys at slots[0 .. m - 1], key i's in
 * lane i (0 past m): a block of keys across the lanes, read once for every query it meets */
AVX512 static void keys_across(__m512 *kt, Rows keys, int64_t m, int chunks) {
    for (int c = 0; c < chunks; c++) {
        __m512 r[16];
        for (int i = 0; i < 16; i++) {
            if (i >= m) {
                r[i] = _mm512_setzero_ps();
                continue;
            }
            int64_t at = keys.slots[i] * keys.stride + 16 * c;
            r[i] = keys.half ? LOAD16H(keys.base, at) : LOAD16(keys.base, at);
        }
        transpose16(r);
        for (int l = 0; l < 16; l++) kt[16 * c + l] = r[l];
    }
}

/* queries scored together from a block of keys across the lanes (scores_across) */
#define ACROSS 4
typedef struct {
    __m512 v[ACROSS];
} Across;

/* lane l of dot16's sums for each query against the block's 16 keys at once: its FMAs over
 * the chunks in dot16's order (key i's in lane i) */
AVX512 static ALWAYS_INLINE Across lane_sums(const float *const q[ACROSS], const __m512 *kt, int l,
                                             int chunks) {
    Across s;
    for (int p = 0; p < ACROSS; p++) s.v[p] = _mm512_setzero_ps();
    for (int c = 0; c < chunks; c++) {
        __m512 k = kt[16 * c + l];
        for (int p = 0; p < ACROSS; p++)
            s.v[p] = _mm512_fmadd_ps(_mm512_set1_ps(q[p][16 * c + l]), k, s.v[p]);
    }
    return s;
}

AVX512 static ALWAYS_INLINE Across across_add(Across a, Across b) {
    for (int p = 0; p < ACROSS; p++) a.v[p] = _mm512_add_ps(a.v[p], b.v[p]);
    return a;
}

/* _mm512_reduce_add_ps's tree over the lanes' sums (lane l + l+8, then + l+4, + l+2, + l+1),
 * each lane a key, so a key's score has dot16's bits (across8(l): lanes l and l + 8; across4(l):
 * across8 of l and l + 4; across2(l): across4 of l and l + 2) */
AVX512 static ALWAYS_INLINE Across across8(const float *const q[ACROSS], const __m512 *kt, int l, int chunks) {
    Across low = lane_sums(q, kt, l, chunks);
    return across_add(low, lane_sums(q, kt, l + 8, chunks));
}

AVX512 static ALWAYS_INLINE Across across4(const float *const q[ACROSS], const __m512 *kt, int l, int chunks) {
    Across low = across8(q, kt, l, chunks);
    return across_add(low, across8(q, kt, l + 4, chunks));
}

AVX512 static ALWAYS_INLINE Across across2(const float *const q[ACROSS], const __m512 *kt, int l, int chunks) {
    Across low = across4(q, kt, l, chunks);
    return across_add(low, across4(q, kt, l + 2, chunks));
}

/* the ACROSS queries' dot16 against each key of the block kt (keys_across), key i in lane i */
#define SCORES_ACROSS(CHUNKS)                                                                      \
    AVX512 static Across scores_across_##CHUNKS(const float *const q[ACROSS], const __m512 *kt) { \
        Across low = across2(q, kt, 0, CHUNKS);                                                    \
        return across_add(low, across2(q, kt, 1, CHUNKS));                                         \
    }
SCORES_ACROSS(4)
SCORES_ACROSS(8)

/* weigh16's sums for several queries at once: out[p] [16 * CHUNKS] += the sum over the block's
 * keys j < m of w[p][j] * v_j, and total[p] += each w[p][j], in key order, each query's
 * operations weigh16's (a key hidden from query p, or past its keys, has w[p][j] 0: adding 0 * v
 * and 0 leaves the sums' bits as skipping the key does, the sums never being -0). The PAIRS
 * queries' sums stay in registers while each key's V is read once for all of them */
#define WEIGH_ACROSS(NAME, CHUNKS, PAIRS, LOAD)                                                    \
    AVX512 static void NAME(float *const out[PAIRS], const float (*w)[16], float *total,           \
                            const int64_t *slots, int64_t m, const void *values,                   \
                            int64_t slot_stride) {                                                 \
        __m512 acc[PAIRS][CHUNKS];                                                                 \
        float sum[PAIRS];                                                                          \
        for (int p = 0; p < PAIRS; p++) {                                                          \
            sum[p] = total[p];                                                                     \
            for (int c = 0; c < CHUNKS; c++) acc[p][c] = _mm512_loadu_ps(out[p] + 16 * c);         \
        }                                                                                          \
        for (int64_t j = 0; j < m; j++) {                                                          \
            int64_t at = slots[j] * slot_stride;                                                   \
            __m512 vv[CHUNKS];                                                                     \
            for (int c = 0; c < CHUNKS; c++) vv[c] = LOAD(values, at + 16 * c);                    \
            for (int p = 0; p < PAIRS; p++) {                                                      \
                __m512 pv = _mm512_set1_ps(w[p][j]);                                               \
                sum[p] += w[p][j];                                                                 \
                for (int c = 0; c < CHUNKS; c++) acc[p][c] = _mm512_fmadd_ps(pv, vv[c], acc[p][c]); \
            }                                                                                      \
        }                                                                                          \
        for (int p = 0; p < PAIRS; p++) {                                                          \
            total[p] = sum[p];                                                                     \
            for (int c = 0; c < CHUNKS; c++) _mm512_storeu_ps(out[p] + 16 * c, acc[p][c]);         \
        }                                                                                          \
    }
#define WEIGH_PAIRS_4 6 /* weigh_across_4's queries: 24 sums and a key's 4 V vectors in registers */
#define WEIGH_PAIRS_8 2
WEIGH_ACROSS(weigh_across_4, 4, WEIGH_PAIRS_4, LOAD16)
WEIGH_ACROSS(weigh_across_8, 8, WEIGH_PAIRS_8, LOAD16)
WEIGH_ACROSS(weigh_acrossh_4, 4, WEIGH_PAIRS_4, LOAD16H)
WEIGH_ACROSS(weigh_acrossh_8, 8, WEIGH_PAIRS_8, LOAD16H)

/* the scores of m keys (scores16 / scores8, head_dim 64 or 128) */
static float scores_block(const Step *S, int64_t d, float *scores, const float *q, const uint8_t *visible,
                          Rows k, int64_t m) {
    float (*fn)(float *, const float *, const uint8_t *, const int64_t *, int64_t, const void *, int64_t, float);
    if (S->lanes == 16)
        fn = d == 64 ? (k.half ? scores16h_4 : scores16_4) : (k.half ? scores16h_8 : scores16_8);
    else
        fn = d == 64 ? (k.half ? scores8h_8 : scores8_8) : (k.half ? scores8h_16 : scores8_16);
    return fn(scores, q, visible, k.slots, m, k.base, k.stride, S->scale);
}

/* out [d] += m values' weighted sums (weigh16 / weigh8, head_dim 64 or 128) */
static float weigh_block(const Step *S, int64_t d, float *out, const float *p, const uint8_t *visible,
                         Rows v, int64_t m, float total) {
    float (*fn)(float *, const float *, const uint8_t *, const int64_t *, int64_t, const void *, int64_t, float);
    if (S->lanes == 16)
        fn = d == 64 ? (v.half ? weigh16h_4 : weigh16_4) : (v.half ? weigh16h_8 : weigh16_8);
    else
        fn = d == 64 ? (v.half ? weigh8h_8 : weigh8_8) : (v.half ? weigh8h_16 : weigh8_16);
    return fn(out, p, visible, v.slots, m, v.base, v.stride, total);
}

/* row t, head h of the attention: q [head_dim] -> out [head_dim]; scores: max_keys floats */
static void attend_row(const Layer *L, const Step *S, int64_t t, int64_t h, const float *q,
                       const void *k_cache, const void *v_cache, float *scores, float *out) {
    int64_t d = L->head_dim, head_offset = (h / (L->num_heads / L->num_kv_heads)) * S->kv_head_stride;
    const int64_t *slots = S->key_slots + S->key_start[t];
    Rows keys = kv_rows(S, k_cache, head_offset, slots);
    Rows values = kv_rows(S, v_cache, head_offset, slots);
    int64_t n = S->num_keys[t];
    const uint8_t *visible = S->mask_start[t] < 0 ? NULL : S->masks + S->mask_start[t];
    float total = 0.0f, top = -INFINITY;
    memset(out, 0, (size_t)d * sizeof(float));
    if (d == 64 || d == 128) {
        top = scores_block(S, d, scores, q, visible, keys, n);
        if (S->lanes == 16)
            softmax_weights16(scores, n, top);
        else
            exp8_n(scores, scores, n, top); /* hidden keys' entries too: unread */
        total = weigh_block(S, d, out, scores, visible, values, n, 0.0f);
    } else {
        float buf[512]; /* a key widened from a float16 cache (MAX_HEAD_DIM 512) */
        for (int64_t j = 0; j < n; j++) {
            if (visible && !visible[j]) continue;
            const float *k = kv_row(keys, j, d, S->lanes, buf);
            float s = (S->lanes == 16 ? dot16(q, k, d) : dot8(q, k, d)) * S->scale;
            scores[j] = s;
            if (s > top) top = s;
        }
        if (S->lanes == 8) exp8_n(scores, scores, n, top); /* hidden keys' entries unread */
        for (int64_t j = 0; j < n; j++) {
            if (visible && !visible[j]) continue;
            float p = S->lanes == 8 ? scores[j] : expf(scores[j] - top);
            total += p;
            const float *v = kv_row(values, j, d, S->lanes, buf);
            if (S->lanes == 16)
                axpy16(out, p, v, d);
            else
                axpy8(out, p, v, d);
        }
    }
    float inverse = 1.0f / total;
    for (int64_t i = 0; i < d; i++) out[i] *= inverse;
}

#define MAX_GROUP 16 /* query heads a KV head attend_block takes */
/* keys (the step's longest row's) from which the attention goes by KV head (attend_block a row)
 * rather than by query head (attend_row); the same bits either way. By KV head a row's work
 * splits into fewer pieces (SmolLM2's one-row step: 3 KV heads over 2 threads, against 9 query
 * heads), which lost while the KV cache was slot-major (a KV head's keys 256 B of each 768 B
 * slot: up to 2,048 keys). With the CPU's KV heads outer it wins or ties from the shortest
 * contexts (the embedded default on the 2-core AMD VM, one in-process loop switching the ways,
 * 1 row at 100 / 1,200 / 3,000 keys 4.56 / 6.46 / 9.42 ms against 4.68 / 7.69 / 11.63; 2 rows
 * 5.43 / 8.09 / 11.82 against 5.31 / 9.08 / 14.86). `layer_grouped_from` sets it and returns
 * what it was (tests: both ways at every length) */
#define GROUPED_FROM_KEYS 0
static int64_t grouped_from = GROUPED_FROM_KEYS;
int64_t layer_grouped_from(int64_t keys) { return swap_setting(&grouped_from, keys); }

/* a block of at most BLOCK_ROWS rows of one sequence (attend_block) */
#define BLOCK_ROWS 16

/* for the block of 16 keys from j0, each of rows t0 .. t0 + R - 1's keys there (written: below
 * its num_keys) and the visible ones of them (live) */
static void block_masks(const Step *S, int64_t t0, int64_t R, const uint8_t *const *visible,
                        int64_t j0, __mmask16 *written, __mmask16 *live) {
    for (int64_t r = 0; r < R; r++) {
        int64_t m = S->num_keys[t0 + r] - j0;
        written[r] = m <= 0 ? 0 : (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1);
        live[r] = written[r];
        if (visible[r])
            for (int64_t i = 0; i < 16 && i < m; i++)
                if (!visible[r][j0 + i]) live[r] &= (__mmask16)~(1u << i);
    }
}

/* (row, query head) pairs from which attend_block scores a block's keys across the lanes
 * (keys_across, then scores_across: ACROSS pairs at once), and from which it weighs the values
 * several pairs at once (weigh_across, WEIGH_PAIRS_4 / _8 at least); the same bits either way.
 * `layer_across_from` / `layer_weigh_across_from` set them and return what they were (tests:
 * every block, or none) */
#define ACROSS_FROM_PAIRS 12
#define WEIGH_ACROSS_FROM_PAIRS 0
static int64_t across_from = ACROSS_FROM_PAIRS, weigh_across_from = WEIGH_ACROSS_FROM_PAIRS;
int64_t layer_across_from(int64_t pairs) { return swap_setting(&across_from, pairs); }
int64_t layer_weigh_across_from(int64_t pairs) { return swap_setting(&weigh_across_from, pairs); }

/* a block of rows t0 .. t0 + R - 1 of one sequence and a KV head, as attend_block and
 * attend_block8 take it: its (row, query head) pairs (p = r * G + g) with their queries, output
 * rows (zeroed), largest scores (-inf) and weights' totals (0), each row's visibility, its keys
 * and values, and its most keys */
typedef struct {
    int64_t t0, d, G, pairs, most;
    Rows keys, values;
    float top[BLOCK_ROWS * MAX_GROUP], total[BLOCK_ROWS * MAX_GROUP];
    const float *queries[BLOCK_ROWS * MAX_GROUP];
    float *outs[BLOCK_ROWS * MAX_GROUP];
    const uint8_t *visible[BLOCK_ROWS];
} Block;

static void block_pairs(Block *B, const Layer *L, const Step *S, int64_t t0, int64_t R, int64_t kv,
                        const float *wide, int64_t qkv_width, const void *k_cache, const void *v_cache,
                        float *out) {
    int64_t d = B->d = L->head_dim, G = B->G = L->num_heads / L->num_kv_heads;
    const int64_t *slots = S->key_slots + S->key_start[t0];
    B->t0 = t0;
    B->pairs = R * G;
    B->most = 0;
    B->keys = kv_rows(S, k_cache, kv * S->kv_head_stride, slots);
    B->values = kv_rows(S, v_cache, kv * S->kv_head_stride, slots);
    for (int64_t r = 0; r < R; r++) {
        int64_t t = t0 + r;
        B->most = S->num_keys[t] > B->most ? S->num_keys[t] : B->most;
        B->visible[r] = S->mask_start[t] < 0 ? NULL : S->masks + S->mask_start[t];
        for (int64_t g = 0; g < G; g++) {
            int64_t p = r * G + g;
            B->top[p] = -INFINITY;
            B->total[p] = 0.0f;
            B->queries[p] = wide + t * qkv_width + (kv * G + g) * d;
            B->outs[p] = out + t * L->num_heads * d + (kv * G + g) * d;
            memset(B->outs[p], 0, (size_t)d * sizeof(float));
        }
    }
}

/* how many of pair p's row's keys lie in the block of `width` keys from j0 (0: none) */
static int64_t pair_keys(const Step *S, const Block *B, int64_t p, int64_t j0, int64_t width) {
    int64_t m = S->num_keys[B->t0 + p / B->G] - j0;
    return m <= 0 ? 0 : m < width ? m : width;
}

/* pairs p0 .. pairs - 1 against the block's `width` keys from j0 (a multiple of 16), pair by
 * pair: each pair's scores there (scores16 / scores8, attend_row's) and its largest so far */
static void pairs_scores(const Step *S, Block *B, int64_t p0, int64_t j0, int64_t width, float *scores) {
    Rows k = B->keys;
    k.slots += j0;
    for (int64_t p = p0; p < B->pairs; p++) {
        int64_t m = pair_keys(S, B, p, j0, width);
        if (!m) continue;
        const uint8_t *seen = B->visible[p / B->G] ? B->visible[p / B->G] + j0 : NULL;
        float block = scores_block(S, B->d, scores + p * S->max_keys + j0, B->queries[p], seen, k, m);
        B->top[p] = block > B->top[p] ? block : B->top[p];
    }
}

/* the same pairs' weighted sums of the block's `width` values from j0, pair by pair (weigh16 /
 * weigh8, attend_row's): each pair's output row and total carried from block to block */
static void pairs_sums(const Step *S, Block *B, int64_t p0, int64_t j0, int64_t width, const float *scores) {
    Rows v = B->values;
    v.slots += j0;
    for (int64_t p = p0; p < B->pairs; p++) {
        int64_t m = pair_keys(S, B, p, j0, width);
        if (!m) continue;
        const uint8_t *seen = B->visible[p / B->G] ? B->visible[p / B->G] + j0 : NULL;
        B->total[p] = weigh_block(S, B->d, B->outs[p], scores + p * S->max_keys + j0, seen, v, m, B->total[p]);
    }
}

/* every pair's output row divided by its total */
static void pairs_normalize(const Block *B) {
    for (int64_t p = 0; p < B->pairs; p++) {
        float inverse = 1.0f / B->total[p];
        for (int64_t i = 0; i < B->d; i++) B->outs[p][i] *= inverse;
    }
}

/* rows t0 .. t0 + R - 1 (R <= BLOCK_ROWS, one sequence's: the same run of key slots) for every
 * query head of KV head `kv` (the heads kv * G .. kv * G + G - 1, G = num_heads / num_kv_heads;
 * 16 lanes, head_dim 64 or 128): each (row, head)'s operations exactly as attend_row's (the same
 * bits: its scores block by block, their largest merged by max, its weighted sum carried from
 * block to block), the rows and heads taken in turn a block of 16 keys at a time, so a block's K
 * and V lines come from memory once for the R rows and G heads (the rest from L1). One row (R
 * 1): "by KV head", past ~2,000 keys (512 B of K and V a key at head_dim 64), where the group's
 * K / V no longer stay in L2 between one head and the next and attend_row's head-by-head passes
 * read them from memory G times. Several: a prefill of n rows otherwise streamed each KV head's
 * keys n times (the embedded default's 3,000-token prefill: 13.3 s). From across_from pairs
 * (row, head), a block's keys go across the lanes once (keys_across) and ACROSS pairs' scores
 * come from them at once (scores_across), and WEIGH_PAIRS pairs' weighted sums take each key's
 * V at once (weigh_across); the rest pair by pair (scores16, weigh16): the same bits (the
 * embedded default's 3,000-token prefill 0.79-0.86x the time on the 2-core AMD VM). Scores
 * across the lanes lost at 6 pairs (a 4-row verify's blocks of 2 rows: 0.99-1.03x against
 * 0.83-0.92x with the weighed sums alone) and tied at 12 at 3,000 tokens (won 0.88-0.92x at
 * 300-1,000), hence ACROSS_FROM_PAIRS; the weighed sums won from 6. Pairs are (row, head) in
 * turn, p = r * G + g. q: wide's rows (qkv_width apart); scores: R * G * max_keys floats; out:
 * the step's attention rows [T, num_heads * d] */
AVX512 static void attend_block(const Layer *L, const Step *S, int64_t t0, int64_t R, int64_t kv,
                                const float *wide, int64_t qkv_width, const void *k_cache,
                                const void *v_cache, float *scores, float *out) {
    Block B;
    block_pairs(&B, L, S, t0, R, kv, wide, qkv_width, k_cache, v_cache, out);
    int64_t d = B.d, G = B.G, pairs = B.pairs, most = B.most;
    float *top = B.top, *total = B.total;
    const float *const *queries = B.queries;
    float *const *outs = B.outs;
    const uint8_t *const *visible = B.visible;
    __m512 kt[8 * 16]; /* a block of keys across the lanes (keys_across), head_dim 128 at most */
    __m512 tops[BLOCK_ROWS * MAX_GROUP]; /* scores_across's largest, lane by lane */
    int weigh_pairs = d == 64 ? WEIGH_PAIRS_4 : WEIGH_PAIRS_8;
    int across = pairs >= across_from, weigh_across = pairs >= weigh_pairs && pairs >= weigh_across_from;
    for (int64_t p = 0; p < pairs; p++) tops[p] = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < most; j0 += 16) {
        int64_t p = 0, mb = most - j0 < 16 ? most - j0 : 16;
        Rows k = B.keys;
        k.slots += j0;
        if (across) {
            __mmask16 written[BLOCK_ROWS], live[BLOCK_ROWS];
            block_masks(S, t0, R, visible, j0, written, live);
            keys_across(kt, k, mb, (int)(d / 16));
            for (; p + ACROSS <= pairs; p += ACROSS) {
                Across s = d == 64 ? scores_across_4(queries + p, kt) : scores_across_8(queries + p, kt);
                for (int i = 0; i < ACROSS; i++) {
                    int64_t r = (p + i) / G;
                    if (!written[r]) continue;
                    __m512 block = _mm512_mul_ps(s.v[i], _mm512_set1_ps(S->scale));
                    _mm512_mask_storeu_ps(scores + (p + i) * S->max_keys + j0, written[r], block);
                    tops[p + i] = _mm512_mask_max_ps(tops[p + i], live[r], tops[p + i], block);
                }
            }
        }
        pairs_scores(S, &B, p, j0, 16, scores);
    }
    for (int64_t p = 0; p < pairs; p++) {
        float best = _mm512_reduce_max_ps(tops[p]); /* max is exact in any order */
        top[p] = best > top[p] ? best : top[p];
        softmax_weights16(scores + p * S->max_keys, S->num_keys[t0 + p / G], top[p]);
    }
    for (int64_t j0 = 0; j0 < most; j0 += 16) {
        int64_t p = 0, mb = most - j0 < 16 ? most - j0 : 16;
        Rows v = B.values;
        v.slots += j0;
        if (weigh_across) {
            __mmask16 written[BLOCK_ROWS], live[BLOCK_ROWS];
            block_masks(S, t0, R, visible, j0, written, live);
            for (; p + weigh_pairs <= pairs; p += weigh_pairs) {
                float w[WEIGH_PAIRS_4][16];
                for (int i = 0; i < weigh_pairs; i++)
                    _mm512_storeu_ps(w[i], _mm512_maskz_loadu_ps(live[(p + i) / G], scores + (p + i) * S->max_keys + j0));
                void (*fn)(float *const *, const float (*)[16], float *, const int64_t *, int64_t, const void *, int64_t);
                fn = d == 64 ? (v.half ? weigh_acrossh_4 : weigh_across_4) : (v.half ? weigh_acrossh_8 : weigh_across_8);
                fn(outs + p, w, total + p, v.slots, mb, v.base, v.stride);
            }
        }
        pairs_sums(S, &B, p, j0, 16, scores);
    }
    pairs_normalize(&B);
}

/* keys a block of attend_block8's: each pair's scores8 / weigh8 call takes a block (16 a call
 * cost a 16-row verify at 3,000 tokens 1.02x attend_row's time on the 2-core AMD VM in AVX2,
 * 64 0.87x, 256 0.90x; a block's K of 64 keys, 16 KB at head_dim 64, stays in L1) */
#define BLOCK8_KEYS 64

/* attend_block with 8 lanes (AVX2): the same blocks of rows, every pair's scores and weighted sums
 * pair by pair a block of BLOCK8_KEYS keys at a time (scores8, weigh8; exp8 for the weights), each
 * pair's operations attend_row's, so the same bits; a block's K / V lines come from memory once
 * for its rows and a KV head's query heads, where attend_row read them again for each (the
 * embedded default's prefill in AVX2 on the 2-core AMD VM: 3,000 tokens 0.73x, 1,000 0.91x; a
 * 4- / 16-row verify at 3,000 tokens 0.87x; blocks of rows from 2 rows, as with 16 lanes; a row
 * alone still goes by query head, attend_row: a row at a time by KV head, 16-key blocks, took a
 * 1,000-token prefill 1.06x its time) */
AVX2 static void attend_block8(const Layer *L, const Step *S, int64_t t0, int64_t R, int64_t kv,
                               const float *wide, int64_t qkv_width, const void *k_cache,
                               const void *v_cache, float *scores, float *out) {
    Block B;
    block_pairs(&B, L, S, t0, R, kv, wide, qkv_width, k_cache, v_cache, out);
    for (int64_t j0 = 0; j0 < B.most; j0 += BLOCK8_KEYS) pairs_scores(S, &B, 0, j0, BLOCK8_KEYS, scores);
    for (int64_t p = 0; p < B.pairs; p++) { /* (hidden keys' entries too: unread) */
        float *sp = scores + p * S->max_keys;
        exp8_n(sp, sp, S->num_keys[t0 + p / B.G], B.top[p]);
    }
    for (int64_t j0 = 0; j0 < B.most; j0 += BLOCK8_KEYS) pairs_sums(S, &B, 0, j0, BLOCK8_KEYS, scores);
    pairs_normalize(&B);
}

/* whether attend_block (attend_block8 with 8 lanes) takes this layer's heads: head_dim 64 or
 * 128, at most MAX_GROUP query heads a KV head */
static int by_kv_head(const Layer *L, const Step *S) {
    return (S->lanes == 16 || S->lanes == 8) && (L->head_dim == 64 || L->head_dim == 128) &&
           L->num_heads / L->num_kv_heads <= MAX_GROUP;
}

/* whether layer_forward's attention goes by KV head, a row at a time (attend_block, one row; 16
 * lanes only, attend_block8 below) */
static int grouped(const Layer *L, const Step *S) {
    return S->lanes == 16 && by_kv_head(L, S) && L->num_heads / L->num_kv_heads > 1 &&
           S->max_keys >= grouped_from;
}

/* steps of at most this many rows that attend by KV head (grouped) split each row's keys over
 * the threads (attend_split) rather than taking a (row, KV head) pair a thread: SmolLM2's one-row
 * step is 3 KV heads for 2 threads, so one thread streams two heads' keys while the other
 * streams one. With the CPU's KV heads outer (specsplit/kv_cache.py), the embedded default's
 * one-row step on the 2-core AMD VM (one in-process loop switching the ways, 6 turns): split
 * 7.26 / 10.01 / 14.14 ms at 1,500 / 3,000 / 6,000 keys against 7.49 / 10.27 / 14.57; on a
 * 16-core Xeon (random SmolLM2-shaped weights, 8,000 keys) 39.3 / 17.2 / 11.6 ms on 2 / 8 / 16
 * threads against 42.0 / 22.4 / 19.5 (two-row and longer steps attend by blocks of rows,
 * attend_block).
 * `layer_split_rows` sets it and returns what it was (tests: 0, no step split, or every step) */
#define SPLIT_ROWS 1
static int64_t split_rows = SPLIT_ROWS;
int64_t layer_split_rows(int64_t rows) { return swap_setting(&split_rows, rows); }
#define SPLIT_KEYS 256 /* keys a piece of attend_split's scores (a multiple of 16) */

/* whether layer_forward's attention goes by KV head with each row's keys split (attend_split) */
static int split(const Layer *L, const Step *S) {
    return S->lanes == 16 && S->threads > 1 && S->num_tokens <= split_rows && grouped(L, S);
}

/* lanes of head_dim a piece of attend_split's weighted sums takes: a whole head's, halved (to
 * 16 at least) while the step's pieces are fewer than the threads. Pieces of one head read the
 * same slots' V a few lines apart, and from DRAM a line's neighbour comes with it: on the 2-core
 * AMD VM 32 lanes of 64 a piece made the split 1.5-1.7x slower than by KV head at 3,000-6,000
 * keys, whole heads 0.96-1.03x (each lane's sum is its own: the same bits at any width) */
static int64_t split_lanes(const Layer *L, const Step *S) {
    int64_t lanes = L->head_dim, pairs = S->num_tokens * L->num_kv_heads;
    while (lanes > 16 && pairs * (L->head_dim / lanes) < S->threads) lanes /= 2;
    return lanes;
}

/* out [16 * chunks] += weigh16's sums (chunks 1, 2, 4 or 8) */
AVX512 static float weigh16_n(int64_t chunks, float *out, const float *p, const uint8_t *visible, Rows v,
                              int64_t n, float total) {
    float (*fn)(float *, const float *, const uint8_t *, const int64_t *, int64_t, const void *, int64_t, float);
    switch (chunks) {
    case 1: fn = v.half ? weigh16h_1 : weigh16_1; break;
    case 2: fn = v.half ? weigh16h_2 : weigh16_2; break;
    case 4: fn = v.half ? weigh16h_4 : weigh16_4; break;
    default: fn = v.half ? weigh16h_8 : weigh16_8;
    }
    return fn(out, p, visible, v.slots, n, v.base, v.stride, total);
}

/* pieces of SPLIT_KEYS keys a row of at most max_keys keys has */
static int64_t key_pieces(int64_t max_keys) { return (max_keys + SPLIT_KEYS - 1) / SPLIT_KEYS; }

/* where row t's piece from key j0 ends (<= j0: the row has no keys there) */
static int64_t piece_end(const Step *S, int64_t t, int64_t j0) {
    int64_t n = S->num_keys[t];
    return j0 + SPLIT_KEYS < n ? j0 + SPLIT_KEYS : n;
}

/* attend_block's attention for every row (one a block) and KV head, each row's work in pieces
 * over the threads, with attend_block's bits: the scores in pieces of SPLIT_KEYS keys (each score alone;
 * a KV head's query heads in turn a block of 16 keys at a time, as there), each piece's largest
 * for each query head; then each piece's weights from the largest over the pieces (max is exact,
 * in any order; each weight alone); then the weighted sums in pieces of split_lanes lanes of
 * head_dim, each lane's sum over every visible key in order as weigh16's (its lanes apart), and
 * the weights' total in the same order in each. q: wide's rows (qkv_width apart); scores: the
 * step's [T, num_heads, max_keys]; tops: [T, num_kv_heads, key_pieces, G]; out: [T, num_heads, d] */
AVX512 static void attend_split(const Layer *L, const Step *S, const float *wide, int64_t qkv_width,
                                const void *k_cache, const void *v_cache, float *scores, float *tops,
                                float *out) {
    int64_t T = S->num_tokens, KV = L->num_kv_heads, d = L->head_dim, G = L->num_heads / KV;
    int64_t pieces = key_pieces(S->max_keys);
    int64_t width = split_lanes(L, S), lane_pieces = d / width;
    int64_t key_units = T * KV * pieces, lane_units = T * KV * lane_pieces;
#pragma omp parallel num_threads(S->threads)
    {
#pragma omp for schedule(static)
        for (int64_t u = 0; u < key_units; u++) { /* the scores, a piece's largest */
            int64_t t = u / (KV * pieces), kv = u / pieces % KV, j0 = u % pieces * SPLIT_KEYS;
            int64_t end = piece_end(S, t, j0);
            const int64_t *slots = S->key_slots + S->key_start[t];
            const uint8_t *visible = S->mask_start[t] < 0 ? NULL : S->masks + S->mask_start[t];
            Rows keys = kv_rows(S, k_cache, kv * S->kv_head_stride, slots);
            const float *q = wide + t * qkv_width + kv * G * d;
            float *top = tops + u * G, *group_scores = scores + (t * L->num_heads + kv * G) * S->max_keys;
            for (int64_t g = 0; g < G; g++) top[g] = -INFINITY;
            for (int64_t j = j0; j < end; j += 16) {
                int64_t m = end - j < 16 ? end - j : 16;
                const uint8_t *seen = visible ? visible + j : NULL;
                Rows k = keys;
                k.slots += j;
                for (int64_t g = 0; g < G; g++) {
                    float block = scores_block(S, d, group_scores + g * S->max_keys + j, q + g * d, seen, k, m);
                    top[g] = block > top[g] ? block : top[g];
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < key_units; u++) { /* the piece's weights */
            int64_t t = u / (KV * pieces), kv = u / pieces % KV, j0 = u % pieces * SPLIT_KEYS;
            int64_t end = piece_end(S, t, j0);
            if (j0 >= end) continue;
            const float *row_tops = tops + (t * KV + kv) * pieces * G;
            float *group_scores = scores + (t * L->num_heads + kv * G) * S->max_keys;
            for (int64_t g = 0; g < G; g++) {
                float top = -INFINITY;
                for (int64_t p = 0; p < pieces; p++)
                    top = row_tops[p * G + g] > top ? row_tops[p * G + g] : top;
                softmax_weights16(group_scores + g * S->max_keys + j0, end - j0, top);
            }
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < lane_units; u++) { /* the weighted sums, `width` lanes each */
            int64_t t = u / (KV * lane_pieces), kv = u / lane_pieces % KV;
            int64_t lanes = u % lane_pieces * width, n = S->num_keys[t];
            const int64_t *slots = S->key_slots + S->key_start[t];
            const uint8_t *visible = S->mask_start[t] < 0 ? NULL : S->masks + S->mask_start[t];
            Rows values = kv_rows(S, v_cache, kv * S->kv_head_stride + lanes, slots);
            const float *group_scores = scores + (t * L->num_heads + kv * G) * S->max_keys;
            float *group_out = out + (t * L->num_heads + kv * G) * d + lanes, total[MAX_GROUP];
            for (int64_t g = 0; g < G; g++) {
                total[g] = 0.0f;
                memset(group_out + g * d, 0, (size_t)width * sizeof(float));
            }
            for (int64_t j = 0; j < n; j += 16) {
                int64_t m = n - j < 16 ? n - j : 16;
                const uint8_t *seen = visible ? visible + j : NULL;
                Rows v = values;
                v.slots += j;
                for (int64_t g = 0; g < G; g++) {
                    const float *pg = group_scores + g * S->max_keys + j;
                    total[g] = weigh16_n(width / 16, group_out + g * d, pg, seen, v, m, total[g]);
                }
            }
            for (int64_t g = 0; g < G; g++) {
                float inverse = 1.0f / total[g], *og = group_out + g * d;
                for (int64_t i = 0; i < width; i++) og[i] *= inverse;
            }
        }
    }
}

/* steps of at least this many rows attend by blocks of a sequence's rows (attend_block);
 * `layer_blocked_from` sets it and returns what it was (tests: every step, or none) */
#define BLOCKED_FROM_ROWS 2
static int64_t blocked_from = BLOCKED_FROM_ROWS;
int64_t layer_blocked_from(int64_t rows) { return swap_setting(&blocked_from, rows); }

/* whether layer_forward's attention goes by blocks of rows (attend_block) */
static int blocked(const Layer *L, const Step *S) {
    return by_kv_head(L, S) && S->num_tokens >= blocked_from;
}

/* where each of the step's blocks of rows starts (starts[0..count], starts[count] = T): each
 * run of consecutive rows of one sequence (the same key_start) cut into the fewest blocks of at
 * most `most` rows, their sizes within one of each other; returns count */
static int64_t row_blocks(const Step *S, int64_t most, int64_t *starts) {
    int64_t count = 0, T = S->num_tokens;
    for (int64_t a = 0, b; a < T; a = b) {
        for (b = a + 1; b < T && S->key_start[b] == S->key_start[a];) b++;
        int64_t pieces = (b - a + most - 1) / most;
        for (int64_t i = 0; i < pieces; i++) starts[count++] = a + i * (b - a) / pieces;
    }
    starts[count] = T;
    return count;
}

/* the step's blocks of rows (row_blocks), of BLOCK_ROWS rows or fewer: halved until the blocks
 * times the KV heads give each thread 2 units or more (a verify of 1 + 15 rows on SmolLM2's 3
 * KV heads is 3 units of 16 rows for 2 threads, one thread taking 2 of them), but blocks of 2
 * rows only until they give each thread one: a block of a row reads its KV head's keys for that
 * row alone, and a sequence's 2-row step (a verify of 1 + 1) in one block took 0.60x the time at
 * 3,000 tokens of context on the 2-core AMD VM (3 units on 2 threads against 6), 0.96x at 200 and
 * 1,000 (the same bits either way) */
static int64_t balanced_blocks(const Layer *L, const Step *S, int64_t *starts) {
    int64_t most = BLOCK_ROWS, count = row_blocks(S, most, starts);
    while (most > 1 && count * L->num_kv_heads < (most > 2 ? 2 : 1) * S->threads)
        count = row_blocks(S, most /= 2, starts);
    return count;
}

/* ---------------------------------------------------------------- the layer */

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) @ W [n, k].T: from the packed runs
 * where the weight has them, else the float32 weights (the same bits); the layer's projections
 * and specsplit/model/cpu_gemm.py's fixed_linear both come here. The packed runs are the faster
 * at every row count since quant_gemm forms each weight once a pass past MR rows (the embedded
 * default's step on the 2-core VM, packed against float32: 1 row 7.1 against 22 ms, 32 rows 62
 * against 79, 256 rows 519 against 548; before, forming once every MR rows lost from ~48). */
void weight_gemm(const Weight *W, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                 int64_t n, int64_t k, int lanes, int threads) {
    if (W->num_runs == 0) {
        fixed_gemm(x, ldx, W->w, k, out, ldo, m, n, k, lanes, threads);
        return;
    }
    int64_t row = 0;
    for (int64_t r = 0; r < W->num_runs; r++) {
        const Run *run = &W->runs[r];
        quant_gemm(x, ldx, run->packed, run->stride, (int)run->kind, out + row, ldo, m, run->rows,
                   k, lanes, threads);
        row += run->rows;
    }
}

/* out [m, n] = x [m, k] @ W [n, k].T (row strides k and n) */
static void project(const Weight *W, const Step *S, const float *x, float *out, int64_t m, int64_t n,
                    int64_t k) {
    weight_gemm(W, x, k, out, n, m, n, k, S->lanes, S->threads);
}

/* a row of layer_forward's `wide` buffer: the qkv projection's, later gate_up's */
static int64_t wide_width(const Layer *L) {
    int64_t qkv = (L->num_heads + 2 * L->num_kv_heads) * L->head_dim;
    return qkv > 2 * L->inter ? qkv : 2 * L->inter;
}

/* floats of scratch a step of num_tokens rows needs (layer_forward's buffers; scores for a KV
 * head's query heads a thread, attend_block's) */
int64_t layer_scratch_floats(const Layer *L, int64_t num_tokens, int64_t max_keys, int threads) {
    int64_t attn = L->num_heads * L->head_dim, per_thread = threads * (L->num_heads / L->num_kv_heads);
    int64_t rows = num_tokens <= split_rows ? num_tokens * L->num_heads : 0; /* attend_split's */
    if (num_tokens >= blocked_from) per_thread *= BLOCK_ROWS; /* attend_block's */
    return num_tokens * (L->hidden + wide_width(L) + attn + L->inter + L->hidden) +
           (per_thread > rows ? per_thread : rows) * max_keys + rows * key_pieces(max_keys);
}

/* act [T, inter] = silu(gate) * up of wide's rows [T, 2 * inter] (gate, then up), elementwise
 * (so the same bits on any split): gate / (1 + e^-gate) * up, e^-gate by exp16 with 16 lanes,
 * exp8 with 8 (each lane alone; the same bits). A scalar expf took ~0.3 ms of a one-row step of
 * the embedded default's 30 layers on two threads (bench/cpu_step.py); exp16's 16 at a time take
 * a row's 1,536 in ~1 us, so only steps of SILU_THREADS_FROM rows and more go over the threads
 * (in pieces of SILU_PIECE): fewer do not pay for the threads' fork and join (~1.5 us) */
#define SILU_PIECE 256
#define SILU_THREADS_FROM 8
AVX512 static void silu_mul16(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 mask = n - i < 16 ? (__mmask16)((1u << (n - i)) - 1) : (__mmask16)0xFFFF;
        __m512 g = _mm512_maskz_loadu_ps(mask, gate + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, mask, _mm512_mul_ps(silu, _mm512_maskz_loadu_ps(mask, up + i)));
    }
}

static void silu_and_mul(const Step *S, const float *wide, float *act, int64_t T, int64_t inter) {
    int64_t pieces = (inter + SILU_PIECE - 1) / SILU_PIECE;
    int threaded = S->threads > 1 && T >= SILU_THREADS_FROM;
#pragma omp parallel for schedule(static) num_threads(S->threads) if (threaded)
    for (int64_t p = 0; p < T * pieces; p++) {
        int64_t t = p / pieces, begin = (p % pieces) * SILU_PIECE;
        int64_t end = begin + SILU_PIECE < inter ? begin + SILU_PIECE : inter;
        const float *gate = wide + t * 2 * inter, *up = gate + inter;
        if (S->lanes == 16) {
            silu_mul16(gate + begin, up + begin, act + t * inter + begin, end - begin);
            continue;
        }
        float *e = act + t * inter + begin; /* e^-gate, then the product in place */
        for (int64_t i = begin; i < end; i++) e[i - begin] = -gate[i];
        exp8_n(e, e, end - begin, 0.0f);
        for (int64_t i = begin; i < end; i++) e[i - begin] = gate[i] / (1.0f + e[i - begin]) * up[i];
    }
}

/* h [T, hidden] (the residual stream) through the layer, in place; k_cache / v_cache
 * [num_slots, num_kv_heads, head_dim] this layer's, float32 or float16 (S->kv_half; S's strides:
 * on the CPU a KV head's slots are contiguous, specsplit/kv_cache.py's heads_outer), the step's
 * K/V written at slot_mapping */
void layer_forward(const Layer *L, const Step *S, float *h, void *k_cache, void *v_cache) {
    int64_t T = S->num_tokens, H = L->hidden, d = L->head_dim;
    int64_t q_width = L->num_heads * d, kv_width = L->num_kv_heads * d;
    int64_t qkv_width = q_width + 2 * kv_width, inter = L->inter;
    int64_t widest = wide_width(L);
    float *normed = S->scratch;            /* [T, H] */
    float *wide = normed + T * H;          /* [T, qkv_width] or [T, 2 * inter] */
    float *attn = wide + T * widest;       /* [T, q_width] */
    float *act = attn + T * q_width;       /* [T, inter] */
    float *proj = act + T * inter;         /* [T, H] */
    float *scores = proj + T * H;          /* [threads, query heads a KV head, max_keys] */

    for (int64_t t = 0; t < T; t++) rms_norm_row(normed + t * H, h + t * H, L->input_norm, H, L->eps);
    project(&L->qkv, S, normed, wide, T, qkv_width, H);
    add_bias(wide, L->qkv_b, T, qkv_width);
    for (int64_t t = 0; t < T; t++) {
        float *row = wide + t * qkv_width, *k = row + q_width, *v = k + kv_width;
        const float *cos = S->cos + t * d, *sin = S->sin + t * d;
        for (int64_t head = 0; head < L->num_heads; head++) {
            float *q = row + head * d;
            if (L->q_norm) rms_norm_row(q, q, L->q_norm, d, L->eps);
            rope_row(q, cos, sin, d);
        }
        for (int64_t head = 0; head < L->num_kv_heads; head++) {
            float *kh = k + head * d;
            if (L->k_norm) rms_norm_row(kh, kh, L->k_norm, d, L->eps);
            rope_row(kh, cos, sin, d);
        }
        for (int64_t head = 0; head < L->num_kv_heads; head++) {
            int64_t at = S->slot_mapping[t] * S->kv_slot_stride + head * S->kv_head_stride;
            if (S->kv_half) {
                narrow_row((uint16_t *)k_cache + at, k + head * d, d);
                narrow_row((uint16_t *)v_cache + at, v + head * d, d);
            } else {
                memcpy((float *)k_cache + at, k + head * d, d * sizeof(float));
                memcpy((float *)v_cache + at, v + head * d, d * sizeof(float));
            }
        }
    }
    int64_t groups = L->num_heads / L->num_kv_heads;
    /* blocks of rows where the step has them (else as many as rows: each row alone) */
    int64_t *starts = NULL, blocks = T;
    if (blocked(L, S)) {
        if (!(starts = malloc((size_t)(T + 1) * sizeof(int64_t)))) abort();
        blocks = balanced_blocks(L, S, starts);
    }
    if (split(L, S)) { /* attend_split: each row's keys over the threads */
        float *tops = scores + T * L->num_heads * S->max_keys;
        attend_split(L, S, wide, qkv_width, k_cache, v_cache, scores, tops, attn);
    } else if (blocks < T) { /* attend_block: a block of a sequence's rows a KV head */
        int64_t units = blocks * L->num_kv_heads;
#pragma omp parallel for schedule(dynamic) num_threads(S->threads) if (S->threads > 1)
        for (int64_t unit = 0; unit < units; unit++) {
            int64_t b = unit / L->num_kv_heads, kv = unit % L->num_kv_heads;
            float *thread_scores = scores + (int64_t)omp_get_thread_num() * BLOCK_ROWS * groups * S->max_keys;
            (S->lanes == 16 ? attend_block : attend_block8)(L, S, starts[b], starts[b + 1] - starts[b], kv,
                                                            wide, qkv_width, k_cache, v_cache, thread_scores, attn);
        }
    } else if (grouped(L, S)) { /* a row's KV head's query heads in one pass over its keys */
        int64_t pairs = T * L->num_kv_heads;
#pragma omp parallel for schedule(static) num_threads(S->threads) if (S->threads > 1)
        for (int64_t pair = 0; pair < pairs; pair++) {
            int64_t t = pair / L->num_kv_heads, kv = pair % L->num_kv_heads;
            float *thread_scores = scores + (int64_t)omp_get_thread_num() * groups * S->max_keys;
            (S->lanes == 16 ? attend_block : attend_block8)(L, S, t, 1, kv, wide, qkv_width, k_cache, v_cache,
                                                            thread_scores, attn);
        }
    } else {
        int64_t pairs = T * L->num_heads;
        /* a one-token step at 200 tokens of context (1,800 key visits) 6.8 -> 6.1 ms in parallel */
        int parallel = S->threads > 1 && pairs * S->max_keys >= 1024;
#pragma omp parallel for schedule(static) num_threads(S->threads) if (parallel)
        for (int64_t pair = 0; pair < pairs; pair++) {
            int64_t t = pair / L->num_heads, head = pair % L->num_heads;
            float *thread_scores = scores + (int64_t)omp_get_thread_num() * S->max_keys;
            attend_row(L, S, t, head, wide + t * qkv_width + head * d, k_cache, v_cache,
                       thread_scores, attn + t * q_width + head * d);
        }
    }
    free(starts);
    project(&L->o, S, attn, proj, T, H, q_width);
    add_bias(proj, L->o_b, T, H);
    for (int64_t i = 0; i < T * H; i++) h[i] += proj[i];
    for (int64_t t = 0; t < T; t++) rms_norm_row(normed + t * H, h + t * H, L->post_norm, H, L->eps);
    project(&L->gate_up, S, normed, wide, T, 2 * inter, H);
    add_bias(wide, L->gate_up_b, T, 2 * inter);
    silu_and_mul(S, wide, act, T, inter);
    project(&L->down, S, act, proj, T, H, inter);
    add_bias(proj, L->down_b, T, H);
    for (int64_t i = 0; i < T * H; i++) h[i] += proj[i];
}

/* layers [count] one after the other (layer_forward each) over h, layer i's K / V caches
 * k_caches[i] / v_caches[i]: a step's run of layers in one call (a call a layer cost the
 * embedded default's one-row step ~0.5 ms of Python and ctypes in its 30 calls) */
void layers_forward(const Layer *const *layers, int64_t count, const Step *S, float *h,
                    void *const *k_caches, void *const *v_caches) {
    for (int64_t i = 0; i < count; i++) layer_forward(layers[i], S, h, k_caches[i], v_caches[i]);
}
