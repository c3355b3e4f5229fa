/* One whole step of a Llama-family model on CPU, in one call (kernels/cpu_decode.py): a set of
 * rows, each one token of a sequence at its position (decode tokens, and the tokens of short
 * prefill chunks), with logits for the rows that sample.
 *
 * Why: on the 2-core dev VM a batch-1 decode step through torch's eager ops spent ~9 of its
 * ~20 ms dispatching ~1,200 small ops; here the step is one OpenMP parallel region whose
 * work-sharing loops read each weight once per step (5-7 ms for int4-g32 SmolLM2-135M).
 *
 * Layouts are the engine's own, read in place (no second copy of any weight):
 *   dense fp32 / bf16 [N, K];  int8 [N, K] + bf16 per-channel scale [N];
 *   int4: torch's CPU pack (_convert_weight_to_int4pack_for_cpu, innerKTiles=1): blocks of
 *   64 output channels, for each k 32 bytes (low nibbles = channels 0-31 of the block, high
 *   = 32-63); scales_and_zeros bf16 [K/g, N, 2] with w = (q - 8) * scale + zero.
 *   int8 VNNI (only with int8_activations): an int8 weight repacked once by cpu_decode.py into
 *   [N/16, K/4, 16, 4] bytes w + 128, and the same per-channel scales. (The same repack of int4
 *   codes measured 1.3-1.6x faster alone, in cache, but 5-10% slower inside whole steps: dropped.)
 *   KV cache [L, num_blocks, block_size, Hkv, D] in fp32 or bf16 (the model dtype).
 * Activations are fp32 throughout and weights are widened in registers, except that with
 * int8_activations the int4 and int8 layers quantize their input to int8 per 32 values (VNNI kernels).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4 = 3, W_INT8_VNNI = 4 };

typedef struct {
    int32_t kind, n, k, group; /* k: real in_features (int4 may store K padded to the group) */
    const void *w;             /* weights (int4: packed bytes) */
    const uint16_t *scales;    /* bf16: int8 [N]; int4 [K/g, N, 2] */
    const float *bias;         /* [N] float32, or NULL */
} Lin;

typedef struct {
    const void *input_norm, *post_norm; /* model dtype [D] */
    Lin qkv, o, gate_up, down;
    const void *q_norm, *k_norm; /* model dtype [head_dim]: per-head RMSNorm of q and k (Qwen3), or NULL */
} Layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab;
    int32_t dtype;    /* W_F32 or W_BF16: embedding, norms, KV cache */
    int32_t block_size;
    float eps, scale;
    int64_t num_blocks;
    const void *embed, *final_norm;
    const float *cos_sin; /* [max_pos, D]: cos in the first half, sin in the second */
    const Layer *layers;
    Lin lm_head;
    void *k_cache, *v_cache;
    /* scratch, fp32, sized for max_batch rows by the caller */
    float *x, *res, *h, *qkv, *att, *gu, *act, *probs; /* probs: [max_batch * Hkv, G, max_ctx] */
    int32_t max_ctx;
    /* int8 activations for the VNNI int4 kernel: codes [max_batch, max_k], scale and sum per 32 */
    int8_t *xq;
    float *xscale, *xsum;
    int32_t max_k;
    int32_t int8_activations; /* int4/int8 layers through the VNNI kernels (kernels.int8_activations) */
    int32_t window;           /* sliding window in keys (Mistral), 0 = none */
    int32_t *ctx_slots;       /* scratch [max_batch, max_ctx]: cache slot of each key of a row */
} Model;

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)v << 16};
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { float f; uint32_t u; } c = {.f = f};
    uint32_t u = c.u;
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline float load_w(const void *p, int dtype, int64_t i) {
    return dtype == W_F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline __m512 load16_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* ---- matmul: out[m, n] = sum_k x[m, k] * W[n, k], rows m < M, channels [n0, n1) ---- */

#define MAX_ROWS 4 /* rows that share one pass over the weights */
#define INLINE static inline __attribute__((always_inline))

/* Row counts and weight kinds are compile-time constants in each instantiation (see the
 * switches below), so the accumulators live in registers; generic loops spilled them. */
INLINE __m512 load16_w(const void *w, int kind, int64_t i) {
    if (kind == W_F32) return _mm512_loadu_ps((const float *)w + i);
    if (kind == W_BF16) return load16_bf16((const uint16_t *)w + i);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w + i))));
}

INLINE float load1_w(const void *w, int kind, int64_t i) {
    return kind == W_INT8 ? (float)((const int8_t *)w)[i] : load_w(w, kind, i);
}

INLINE void dense_rows_t(const Lin *L, const float *x, int ldx, float *out, int ldo, const int M, const int kind,
                         int n0, int n1) {
    const int K = L->k;
    for (int n = n0; n < n1; n++) {
        const int64_t row = (int64_t)n * K;
        __m512 acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        int k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m512 w = load16_w(L->w, kind, row + k);
            for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + (int64_t)m * ldx + k), acc[m]);
        }
        const float s = kind == W_INT8 ? bf16_to_f32(L->scales[n]) : 1.0f;
        for (int m = 0; m < M; m++) {
            float t = _mm512_reduce_add_ps(acc[m]);
            for (int kk = k; kk < K; kk++) t += load1_w(L->w, kind, row + kk) * x[(int64_t)m * ldx + kk];
            out[(int64_t)m * ldo + n] = t * s;
        }
    }
}

#define DENSE_CASE(KIND)                                                                 \
    switch (M) {                                                                         \
    case 1: dense_rows_t(L, x, ldx, out, ldo, 1, KIND, n0, n1); break;                   \
    case 2: dense_rows_t(L, x, ldx, out, ldo, 2, KIND, n0, n1); break;                   \
    case 3: dense_rows_t(L, x, ldx, out, ldo, 3, KIND, n0, n1); break;                   \
    default: dense_rows_t(L, x, ldx, out, ldo, 4, KIND, n0, n1); break;                  \
    }

static void dense_rows(const Lin *L, const float *x, int ldx, float *out, int ldo, int M, int n0, int n1) {
    if (L->kind == W_F32) { DENSE_CASE(W_F32) }
    else if (L->kind == W_BF16) { DENSE_CASE(W_BF16) }
    else { DENSE_CASE(W_INT8) }
}

/* Scale and offset (zero - 8 * scale) of the 64 channels of block b for the group starting at k0:
 * sc[j], off[j] cover channels 16j..16j+15. The pack stores (scale, zero) bf16 pairs [K/g, N, 2]. */
INLINE void int4_group_scales(const Lin *L, int b, int k0, __m512 sc[4], __m512 off[4]) {
    const uint16_t *sz = L->scales + ((int64_t)(k0 / L->group) * L->n + (int64_t)b * 64) * 2;
    for (int j = 0; j < 4; j++) {
        const __m512i pairs = _mm512_loadu_si512((const void *)(sz + j * 32)); /* 16 x (scale, zero) */
        sc[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 ze = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
        off[j] = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), sc[j], ze);
    }
}

/* One 64-channel block `b` of an int4 weight; K stored padded to the group, the real K's tail skipped. */
INLINE void int4_block_rows_t(const Lin *L, const float *x, int ldx, float *out, int ldo, const int M, int b) {
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g;
    const uint8_t *p = (const uint8_t *)L->w + (int64_t)b * Kp * 32;
    const __m256i nib = _mm256_set1_epi8(0x0f);
    __m512 tot[MAX_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) tot[m][j] = _mm512_setzero_ps();
    for (int k0 = 0; k0 < K; k0 += g) {
        const int k1 = k0 + g < K ? k0 + g : K;
        __m512 acc[MAX_ROWS][4];
        float sx[MAX_ROWS];
        for (int m = 0; m < M; m++) {
            const float *xr = x + (int64_t)m * ldx;
            __m512 s = _mm512_setzero_ps();
            int k = k0;
            for (; k + 16 <= k1; k += 16) s = _mm512_add_ps(s, _mm512_loadu_ps(xr + k));
            sx[m] = _mm512_reduce_add_ps(s);
            for (; k < k1; k++) sx[m] += xr[k];
            for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();
        }
        for (int k = k0; k < k1; k++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + (int64_t)k * 32));
            __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
            __m512 w[4] = {
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi))),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))),
            };
            for (int m = 0; m < M; m++) {
                const __m512 xb = _mm512_set1_ps(x[(int64_t)m * ldx + k]);
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(w[j], xb, acc[m][j]);
            }
        }
        __m512 sc[4], off[4];
        int4_group_scales(L, b, k0, sc, off);
        for (int j = 0; j < 4; j++)
            for (int m = 0; m < M; m++) {
                tot[m][j] = _mm512_fmadd_ps(sc[j], acc[m][j], tot[m][j]);
                tot[m][j] = _mm512_fmadd_ps(off[j], _mm512_set1_ps(sx[m]), tot[m][j]);
            }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + (int64_t)m * ldo + b * 64 + j * 16, tot[m][j]);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define HAVE_VNNI 1
/* int4 x int8 with VNNI (what ggml does for Q4 x Q8): activations quantized per 32 inputs
 * (symmetric int8, one float scale each), `vpdpbusd` multiplies 4 unsigned weight codes by 4
 * signed activation codes per lane and sums them into int32. `vpermt2b` gathers, from four
 * 32-byte rows k..k+3 of the CPU pack, each channel's 4 codes into one 32-bit lane in channel
 * order, so scales apply without permuting. 4x fewer vector ops per weight than widening to
 * float32, and the same work serves every row of the batch.
 *   sum_k w x = scale * sum_b dx_b * sum_{k in b} q_k qx_k + (zero - 8 scale) * sum_k x_k   */

/* x [M, K] -> codes and a scale per 32 inputs (K % 32 == 0), and per 32 a sum: of the float inputs
 * when exact_sum (the int4 kernel's zero-point term), else of the codes times the scale (the int8
 * kernel's correction for its unsigned weights, exact in integers). */
static void quantize_rows(const Model *md, const float *x, int ldx, int M, int K, int exact_sum) {
    const int nb = K / 32;
#pragma omp for schedule(static)
    for (int t = 0; t < M * nb; t++) {
        const int m = t / nb, b = t % nb;
        const float *xr = x + (int64_t)m * ldx + b * 32;
        const __m512 v0 = _mm512_loadu_ps(xr), v1 = _mm512_loadu_ps(xr + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 s = _mm512_set1_ps(inv);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
        int8_t *dst = md->xq + (int64_t)m * md->max_k + b * 32;
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(q1));
        md->xscale[(int64_t)m * (md->max_k / 32) + b] = d;
        md->xsum[(int64_t)m * (md->max_k / 32) + b] =
            exact_sum ? _mm512_reduce_add_ps(_mm512_add_ps(v0, v1)) : d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* int8 weights x int8 activations, 16 channels (block c) for rows m0..m0+M-1. One vector of the
 * repacked weight holds 16 channels x 4 inputs, so `vpdpbusd` against 4 broadcast activation codes
 * accumulates 16 outputs with no horizontal reduction (the row-major layout needed one per output
 * and lost to float FMAs: 39 vs 32 ms for the LM head at 64 rows). Weights are stored + 128 since
 * vpdpbusd multiplies unsigned by signed bytes:
 *   sum_k w x = ws_n * sum_b dx_b (sum_{k in b} (w + 128) qx  -  128 sum_{k in b} qx)          */
INLINE void int8_vnni_rows_t(const Model *md, const Lin *L, float *out, int ldo, const int M, int m0, int c) {
    const int nb = L->k / 32, ldq = md->max_k, lds = md->max_k / 32;
    const __m512i *w = (const __m512i *)((const uint8_t *)L->w + (int64_t)c * L->k * 16);
    __m512 tot[8];
    for (int m = 0; m < M; m++) tot[m] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m512i acc[8];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_si512();
        for (int q = 0; q < 8; q++) {
            const __m512i wv = _mm512_loadu_si512(w + b * 8 + q);
            for (int m = 0; m < M; m++)
                acc[m] = _mm512_dpbusd_epi32(acc[m], wv, _mm512_set1_epi32(*(const int32_t *)(md->xq + (int64_t)(m0 + m) * ldq + b * 32 + 4 * q)));
        }
        for (int m = 0; m < M; m++)
            tot[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[m]), _mm512_set1_ps(md->xscale[(int64_t)(m0 + m) * lds + b]), tot[m]);
    }
    const __m512 ws = load16_bf16(L->scales + c * 16);
    for (int m = 0; m < M; m++) {
        float corr = 0.0f;
        for (int b = 0; b < nb; b++) corr += md->xsum[(int64_t)(m0 + m) * lds + b];
        const __m512 t = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_set1_ps(corr), tot[m]);
        _mm512_storeu_ps(out + (int64_t)(m0 + m) * ldo + c * 16, _mm512_mul_ps(ws, t));
    }
}

#define ROWS_SWITCH(FN)                                                   \
    for (int m0 = 0; m0 < M; m0 += 8) {                                   \
        switch (M - m0 < 8 ? M - m0 : 8) {                                \
        case 1: FN(md, L, out, ldo, 1, m0, c); break;                     \
        case 2: FN(md, L, out, ldo, 2, m0, c); break;                     \
        case 3: FN(md, L, out, ldo, 3, m0, c); break;                     \
        case 4: FN(md, L, out, ldo, 4, m0, c); break;                     \
        case 5: FN(md, L, out, ldo, 5, m0, c); break;                     \
        case 6: FN(md, L, out, ldo, 6, m0, c); break;                     \
        case 7: FN(md, L, out, ldo, 7, m0, c); break;                     \
        default: FN(md, L, out, ldo, 8, m0, c); break;                    \
        }                                                                 \
    }

static void int8_vnni_rows(const Model *md, const Lin *L, float *out, int ldo, int M, int c) { ROWS_SWITCH(int8_vnni_rows_t) }

/* One 64-channel block b for every row: each 32-input slice of the weights is unpacked once into
 * VNNI order (8 quads x 4 vectors, 2 KB, stays in L1), then every row streams over it with four
 * accumulators, so the unpacking is shared by all rows and nothing spills. */
static void int4_vnni_block(const Model *md, const Lin *L, float *out, int ldo, int M, int b) {
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g, ldq = md->max_k, lds = md->max_k / 32;
    const uint8_t *p = (const uint8_t *)L->w + (int64_t)b * Kp * 32;
    /* lane c of the output takes byte c of rows k, k+1 (first source) and k+2, k+3 (second) */
    uint8_t lo[64], hi[64];
    for (int c = 0; c < 16; c++)
        for (int i = 0; i < 4; i++) {
            lo[c * 4 + i] = (uint8_t)((i & 2 ? 64 : 0) + (i & 1) * 32 + c);
            hi[c * 4 + i] = (uint8_t)((i & 2 ? 64 : 0) + (i & 1) * 32 + 16 + c);
        }
    const __m512i idx_lo = _mm512_loadu_si512(lo), idx_hi = _mm512_loadu_si512(hi), nib = _mm512_set1_epi8(0x0f);
    __m512i wq[8][4]; /* one 32-input slice, unpacked */
    for (int m = 0; m < M; m++) memset(out + (int64_t)m * ldo + b * 64, 0, 64 * sizeof(float));
    for (int k0 = 0; k0 < K; k0 += g) {
        const int k1 = k0 + g < K ? k0 + g : K;
        __m512 sc[4], off[4];
        int4_group_scales(L, b, k0, sc, off);
        for (int kb = k0; kb < k1; kb += 32) {
            for (int q = 0; q < 8; q++) {
                const __m512i r01 = _mm512_loadu_si512((const void *)(p + (int64_t)(kb + 4 * q) * 32));
                const __m512i r23 = _mm512_loadu_si512((const void *)(p + (int64_t)(kb + 4 * q) * 32 + 64));
                const __m512i a = _mm512_permutex2var_epi8(r01, idx_lo, r23); /* channels 0-15 | 32-47 */
                const __m512i c = _mm512_permutex2var_epi8(r01, idx_hi, r23); /* channels 16-31 | 48-63 */
                wq[q][0] = _mm512_and_si512(a, nib);
                wq[q][1] = _mm512_and_si512(c, nib);
                wq[q][2] = _mm512_and_si512(_mm512_srli_epi16(a, 4), nib);
                wq[q][3] = _mm512_and_si512(_mm512_srli_epi16(c, 4), nib);
            }
            for (int m = 0; m < M; m++) {
                const int8_t *xr = md->xq + (int64_t)m * ldq + kb;
                __m512i acc[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
                for (int q = 0; q < 8; q++) {
                    const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(xr + 4 * q));
                    for (int j = 0; j < 4; j++) acc[j] = _mm512_dpbusd_epi32(acc[j], wq[q][j], xb);
                }
                const __m512 dx = _mm512_set1_ps(md->xscale[(int64_t)m * lds + kb / 32]);
                float *o = out + (int64_t)m * ldo + b * 64;
                for (int j = 0; j < 4; j++)
                    _mm512_storeu_ps(o + j * 16, _mm512_fmadd_ps(_mm512_mul_ps(sc[j], dx), _mm512_cvtepi32_ps(acc[j]),
                                                                 _mm512_loadu_ps(o + j * 16)));
            }
        }
        for (int m = 0; m < M; m++) {
            float sx = 0.0f;
            for (int kb = k0; kb < k1; kb += 32) sx += md->xsum[(int64_t)m * lds + kb / 32];
            float *o = out + (int64_t)m * ldo + b * 64;
            for (int j = 0; j < 4; j++)
                _mm512_storeu_ps(o + j * 16, _mm512_fmadd_ps(off[j], _mm512_set1_ps(sx), _mm512_loadu_ps(o + j * 16)));
        }
    }
}
#endif

static void int4_block_rows(const Lin *L, const float *x, int ldx, float *out, int ldo, int M, int b) {
    switch (M) {
    case 1: int4_block_rows_t(L, x, ldx, out, ldo, 1, b); break;
    case 2: int4_block_rows_t(L, x, ldx, out, ldo, 2, b); break;
    case 3: int4_block_rows_t(L, x, ldx, out, ldo, 3, b); break;
    default: int4_block_rows_t(L, x, ldx, out, ldo, 4, b); break;
    }
}

/* out[M, N] = x[M, K] @ W^T, shared by the threads of the enclosing parallel region. */
static void matmul_nobias(const Model *md, const Lin *L, const float *x, int ldx, float *out, int ldo, int M) {
#ifdef HAVE_VNNI
    if (L->kind == W_INT8_VNNI) { /* repacked (cpu_decode.py) only with int8_activations, K % 32 == 0, N % 16 == 0 */
        quantize_rows(md, x, ldx, M, L->k, 0);
#pragma omp for schedule(static)
        for (int c = 0; c < L->n / 16; c++) int8_vnni_rows(md, L, out, ldo, M, c);
        return;
    }
    if (md->int8_activations && L->kind == W_INT4 && L->k % 32 == 0 && L->group % 32 == 0) {
        quantize_rows(md, x, ldx, M, L->k, 1);
#pragma omp for schedule(static)
        for (int b = 0; b < L->n / 64; b++) int4_vnni_block(md, L, out, ldo, M, b);
        return;
    }
#endif
    if (L->kind == W_INT4) {
#pragma omp for schedule(static)
        for (int b = 0; b < L->n / 64; b++)
            for (int m0 = 0; m0 < M; m0 += MAX_ROWS)
                int4_block_rows(L, x + (int64_t)m0 * ldx, ldx, out + (int64_t)m0 * ldo, ldo,
                                M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS, b);
        return;
    }
    const int chunk = 16, nc = (L->n + chunk - 1) / chunk;
#pragma omp for schedule(static)
    for (int c = 0; c < nc; c++) {
        const int n1 = (c + 1) * chunk < L->n ? (c + 1) * chunk : L->n;
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS)
            dense_rows(L, x + (int64_t)m0 * ldx, ldx, out + (int64_t)m0 * ldo, ldo,
                       M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS, c * chunk, n1);
    }
}

/* ---- pointwise ---- */

/* e^x for 16 lanes: 2^n * e^f, n = round(x / ln 2), |f| <= ln(2) / 2, degree-6 Taylor (relative
 * error < 4e-7). Scalar expf calls were 7 of a 120 ms step at batch 64 (SiLU and softmax). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-103.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), f);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* p[0:n] = softmax(p[0:n]) in place. */
static void softmax(float *p, int n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, p + j));
    }
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), m)));
        _mm512_mask_storeu_ps(p + j, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int j = 0; j < n; j += 16) {
        const __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(p + j, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + j), inv));
    }
}

/* act[m, :] = silu(gu[m, :I]) * gu[m, I:] */
static void silu_mul(const float *gu, float *act, int M, int I) {
    const int nc = (I + 15) / 16;
#pragma omp for schedule(static)
    for (int t = 0; t < M * nc; t++) {
        const int m = t / nc, i = (t % nc) * 16;
        const __mmask16 k = I - i >= 16 ? 0xffff : (__mmask16)((1u << (I - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(k, gu + (int64_t)m * 2 * I + i);
        const __m512 u = _mm512_maskz_loadu_ps(k, gu + (int64_t)m * 2 * I + I + i);
        const __m512 sg = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(act + (int64_t)m * I + i, k, _mm512_mul_ps(sg, u));
    }
}

/* h = rms_norm(x + res) * w; res = x + res (or x when first). Rows split over threads. */
static void add_rms_norm(const Model *md, const void *w, float *x, float *res, float *h, int M, int first) {
    const int D = md->hidden;
#pragma omp for schedule(static)
    for (int m = 0; m < M; m++) {
        float *xr = x + (int64_t)m * D, *rr = res + (int64_t)m * D, *hr = h + (int64_t)m * D;
        double ss = 0.0;
        for (int i = 0; i < D; i++) {
            float v = first ? xr[i] : xr[i] + rr[i];
            rr[i] = v;
            ss += (double)v * v;
        }
        const float r = 1.0f / sqrtf((float)(ss / D) + md->eps);
        for (int i = 0; i < D; i++) hr[i] = rr[i] * r * load_w(w, md->dtype, i);
    }
}

/* v[0:n] = rms_norm(v) * w, in place (one head of q or k). */
static void head_rms_norm(float *v, const void *w, int dtype, int n, float eps) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        const __m512 x = _mm512_loadu_ps(v + i); /* n % 16 == 0 (cpu_decode.py checks head_dim) */
        ss = _mm512_fmadd_ps(x, x, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / n + eps));
    for (int i = 0; i < n; i += 16) {
        const __m512 wv = dtype == W_F32 ? _mm512_loadu_ps((const float *)w + i) : load16_bf16((const uint16_t *)w + i);
        _mm512_storeu_ps(v + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(v + i), r), wv));
    }
}

static void rotate(float *v, const float *cs, int half) { /* rotate-half RoPE: cos in cs[:half], sin in cs[half:] */
    for (int i = 0; i < half; i += 16) {
        const __mmask16 k = half - i >= 16 ? 0xffff : (__mmask16)((1u << (half - i)) - 1);
        const __m512 a = _mm512_maskz_loadu_ps(k, v + i), b = _mm512_maskz_loadu_ps(k, v + i + half);
        const __m512 c = _mm512_maskz_loadu_ps(k, cs + i), sn = _mm512_maskz_loadu_ps(k, cs + i + half);
        _mm512_mask_storeu_ps(v + i, k, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, sn)));
        _mm512_mask_storeu_ps(v + i + half, k, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, sn)));
    }
}

static inline void put_kv(void *cache, int dtype, int64_t off, const float *src, int n) {
    if (dtype == W_F32) {
        memcpy((float *)cache + off, src, (size_t)n * sizeof(float));
        return;
    }
    int i = 0;
#ifdef __AVX512BF16__
    for (; i + 16 <= n; i += 16) /* round to nearest even, as f32_to_bf16 */
        _mm256_storeu_si256((__m256i *)((uint16_t *)cache + off + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    for (; i < n; i++) ((uint16_t *)cache)[off + i] = f32_to_bf16(src[i]);
}

/* The cache rows of one head are a few hundred bytes apart and scattered over pages: the hardware
 * prefetcher missed them and every row cost a memory latency (attention was 1.4 of a 7 ms step). */
#define PREFETCH_AHEAD 6
static inline void prefetch_row(const void *cache, int dtype, int64_t off, int n) {
    const char *p = (const char *)cache + off * (dtype == W_F32 ? 4 : 2);
    for (int b = 0; b < n * (dtype == W_F32 ? 4 : 2); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

/* r[i] = sum of the 16 lanes of a[i]: a transpose-and-add tree, 45 shuffles and adds for 16 sums
 * (a horizontal reduce per key cost ~8 dependent ops each). */
static inline __m512 hsum16(const __m512 a[16]) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

#define ATT_CHUNK 16
/* One (sequence, kv head) task: its G query heads q [G, hd] over keys j0..L-1 of the paged cache
 * -> o [G, hd]. Keys go 16 at a time: the chunk's K rows are widened to float32 once into kt, each
 * query head's 16 scores come out of one hsum16; then softmax; then V with the output held in
 * registers, 64 dims x up to 4 heads at a time. p: [G, max_ctx] scratch. */
static void attend(const Model *md, const float *q, float *o, float *p, float *kt, int64_t base, const int32_t *cslot,
                   int kh, int j0, int L) {
    const int hd = md->head_dim, G = md->num_heads / md->num_kv_heads, row = md->num_kv_heads * hd;
    base += (int64_t)kh * hd;
#define KV_OFF(j) (base + (int64_t)cslot[j] * row)
    const int nv = hd / 16, n = L - j0; /* hd % 16 == 0 (checked by cpu_decode.py) */
    for (int c = 0; c < n; c += ATT_CHUNK) {
        const int cn = n - c < ATT_CHUNK ? n - c : ATT_CHUNK;
        for (int jj = 0; jj < cn; jj++) {
            const int j = j0 + c + jj;
            const int ja = j + ATT_CHUNK < L ? j + ATT_CHUNK : j;
            prefetch_row(md->k_cache, md->dtype, KV_OFF(ja), hd);
            const int64_t off = KV_OFF(j);
            for (int v = 0; v < nv; v++)
                _mm512_storeu_ps(kt + jj * hd + v * 16, md->dtype == W_F32 ? _mm512_loadu_ps((const float *)md->k_cache + off + v * 16)
                                                                           : load16_bf16((const uint16_t *)md->k_cache + off + v * 16));
        }
        for (int g = 0; g < G; g++) {
            __m512 acc[ATT_CHUNK];
            for (int jj = 0; jj < ATT_CHUNK; jj++) {
                acc[jj] = _mm512_setzero_ps();
                if (jj < cn)
                    for (int v = 0; v < nv; v++) acc[jj] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * hd + v * 16), _mm512_loadu_ps(kt + jj * hd + v * 16), acc[jj]);
            }
            const __mmask16 k = cn == 16 ? 0xffff : (__mmask16)((1u << cn) - 1);
            _mm512_mask_storeu_ps(p + g * md->max_ctx + c, k, _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(md->scale)));
        }
    }
    for (int g = 0; g < G; g++) softmax(p + g * md->max_ctx, n);
    for (int d0 = 0; d0 < hd; d0 += 64) {
        const int vn = (hd - d0) / 16 < 4 ? (hd - d0) / 16 : 4;
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int gn = G - g0 < 4 ? G - g0 : 4;
            __m512 acc[4][4];
            for (int g = 0; g < 4; g++)
                for (int v = 0; v < 4; v++) acc[g][v] = _mm512_setzero_ps();
            for (int jj = 0; jj < n; jj++) {
                const int j = j0 + jj;
                const int ja = j + ATT_CHUNK < L ? j + ATT_CHUNK : j;
                if (d0 == 0 && g0 == 0) prefetch_row(md->v_cache, md->dtype, KV_OFF(ja), hd);
                const int64_t off = KV_OFF(j) + d0;
                __m512 vr[4];
                for (int v = 0; v < vn; v++)
                    vr[v] = md->dtype == W_F32 ? _mm512_loadu_ps((const float *)md->v_cache + off + v * 16)
                                               : load16_bf16((const uint16_t *)md->v_cache + off + v * 16);
                for (int g = 0; g < gn; g++) {
                    const __m512 pj = _mm512_set1_ps(p[(g0 + g) * md->max_ctx + jj]);
                    for (int v = 0; v < vn; v++) acc[g][v] = _mm512_fmadd_ps(pj, vr[v], acc[g][v]);
                }
            }
            for (int g = 0; g < gn; g++)
                for (int v = 0; v < vn; v++) _mm512_storeu_ps(o + (g0 + g) * hd + d0 + v * 16, acc[g][v]);
        }
    }
}
#undef KV_OFF

static void matmul(const Model *md, const Lin *L, const float *x, int ldx, float *out, int ldo, int M) {
    matmul_nobias(md, L, x, ldx, out, ldo, M);
    if (L->bias) {
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < L->n; n++) out[(int64_t)m * ldo + n] += L->bias[n];
    }
}

/* out[M, N] = x[M, K] @ W^T on its own: the matmul kernels' test entry (tests/kernels_tests). */
void slotune_matmul(const Model *md, const Lin *L, const float *x, float *out, int M, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    matmul(md, L, x, L->k, out, L->n, M);
}

/* ---- the step ---- */

/* ids, pos, slots: [M]; block_tables [M, bt_width] int32; logits out [num_logit_rows, vocab] fp32
 * for the rows listed in logit_rows. Each row is one token of a sequence at position pos, attending
 * to pos + 1 keys (itself included): a decode row, or one row of a prefill chunk, whose K/V all
 * rows store before any row attends. */
void slotune_decode_step(const Model *md, int M, const int64_t *ids, const int64_t *pos, const int64_t *slots,
                         const int32_t *block_tables, int bt_width, const int32_t *logit_rows, int num_logit_rows,
                         float *logits, int num_threads) {
    const int D = md->hidden, H = md->num_heads, Hkv = md->num_kv_heads, hd = md->head_dim, G = H / Hkv;
    const int qkv_n = (H + 2 * Hkv) * hd, I = md->inter, bs = md->block_size;
    const int64_t layer_stride = md->num_blocks * bs * Hkv * hd;
#pragma omp parallel num_threads(num_threads)
    {
        float kt[ATT_CHUNK * 512]; /* one chunk of K rows widened to float32 (head_dim <= 512) */
#pragma omp for schedule(static)
        for (int m = 0; m < M; m++) {
            for (int i = 0; i < D; i++) md->x[(int64_t)m * D + i] = load_w(md->embed, md->dtype, ids[m] * D + i);
            /* cache slot of every key of this row, once per step for all layers and heads: a
             * division per key and head in the attention loop was ~1/2 of its time at 64 rows */
            const int32_t *bt = block_tables + (int64_t)m * bt_width;
            int32_t *cs = md->ctx_slots + (int64_t)m * md->max_ctx;
            for (int j = 0, b = 0; j <= pos[m]; b++)
                for (int i = 0; i < bs && j <= pos[m]; i++, j++) cs[j] = bt[b] * bs + i;
        }
        for (int l = 0; l < md->num_layers; l++) {
            const Layer *ly = &md->layers[l];
            add_rms_norm(md, ly->input_norm, md->x, md->res, md->h, M, l == 0);
            matmul(md, &ly->qkv, md->h, D, md->qkv, qkv_n, M);
            /* (q/k norm,) rotary on q and k heads, then store k and v at the token's slot */
#pragma omp for schedule(static)
            for (int m = 0; m < M; m++) {
                float *r = md->qkv + (int64_t)m * qkv_n;
                const float *cs = md->cos_sin + pos[m] * hd;
                for (int h = 0; h < H + Hkv; h++) {
                    if (ly->q_norm) head_rms_norm(r + h * hd, h < H ? ly->q_norm : ly->k_norm, md->dtype, hd, md->eps);
                    rotate(r + h * hd, cs, hd / 2);
                }
                if (slots[m] >= 0) {
                    const int64_t off = l * layer_stride + slots[m] * Hkv * hd;
                    put_kv(md->k_cache, md->dtype, off, r + H * hd, Hkv * hd);
                    put_kv(md->v_cache, md->dtype, off, r + (H + Hkv) * hd, Hkv * hd);
                }
            }
            /* attention: one task per (sequence, kv head), its G query heads together; a sliding
             * window keeps the last `window` keys (the token itself included) */
#pragma omp for schedule(static)
            for (int t = 0; t < M * Hkv; t++) {
                const int m = t / Hkv, kh = t % Hkv, L = (int)pos[m] + 1;
                const int j0 = md->window > 0 && L > md->window ? L - md->window : 0;
                attend(md, md->qkv + (int64_t)m * qkv_n + kh * G * hd, md->att + (int64_t)m * H * hd + kh * G * hd,
                       md->probs + (int64_t)t * G * md->max_ctx, kt, l * layer_stride, md->ctx_slots + (int64_t)m * md->max_ctx,
                       kh, j0, L);
            }
            matmul(md, &ly->o, md->att, H * hd, md->x, D, M);
            add_rms_norm(md, ly->post_norm, md->x, md->res, md->h, M, 0);
            matmul(md, &ly->gate_up, md->h, D, md->gu, 2 * I, M);
            silu_mul(md->gu, md->act, M, I);
            matmul(md, &ly->down, md->act, I, md->x, D, M);
        }
        add_rms_norm(md, md->final_norm, md->x, md->res, md->h, M, 0);
#pragma omp for schedule(static)
        for (int r = 0; r < num_logit_rows; r++) /* only the rows that sample pay for the LM head */
            memcpy(md->x + (int64_t)r * D, md->h + (int64_t)logit_rows[r] * D, (size_t)D * sizeof(float));
        matmul(md, &md->lm_head, md->x, D, logits, md->vocab, num_logit_rows);
    }
}
