/* One whole step of a Llama-family model on CPU, in one call (slotune/kernels/cpu_decode.py): a set of
 * rows, each one token of a sequence at its position (decode tokens, and the tokens of short
 * prefill chunks), with logits for the rows that sample.
 *
 * Why: through torch's eager ops a small decode step spends much of its time dispatching ~1,200
 * small ops; here the step is one OpenMP parallel region whose work-sharing loops read each weight
 * once per step (measurements: docs/design/kernels-cpu-decode.md). Its loops are `static`: each
 * thread's share is fixed, so a loop costs one barrier and no shared counter, which a `guided` loop's
 * every grab moves between the cores (served at batch 1 with the two vCPUs on different L3s, guided
 * took 1.23x the p95 TPOT). -DSLOTUNE_SCHEDULE=guided (SLOTUNE_NATIVE_CFLAGS) builds the other.
 *
 * Two instruction sets from this one source, chosen at compile time (-march=native): AVX-512
 * (F/BW/VL/DQ; 16-lane vectors, the VNNI kernels where AVX512-VNNI/VBMI exist) and AVX2 + FMA
 * (8-lane vectors, `vpmaddubsw` int8 kernels as llama.cpp's AVX2 Q8 dot). The float kernels are
 * written once over a thin vector layer (vf_*, VL lanes); only the integer dot products and the
 * int4 unpacking differ per ISA. slotune_isa() reports what was compiled in, and cpu_decode.py
 * repacks weights from that report, never from its own reading of the CPU flags. Where the build has
 * AMX (AMX-INT8/TILE) and Linux grants tile state, batches of 16+ rows run the int8-activation
 * kernels' whole 16-row tiles on AMX over the VNNI layouts, with the VNNI kernels' exact results.
 *
 * Layouts are the engine's own, read in place (no second copy of any weight):
 *   dense fp32 / bf16 [N, K];  int8 [N, K] + bf16 per-channel scale [N];
 *   int4: torch's CPU pack (_convert_weight_to_int4pack_for_cpu, innerKTiles=1), laid out for
 *   torch's runtime ISA: under AVX-512 blocks of 64 output channels, for each k 32 bytes (low
 *   nibbles = channels 0-31 of the block, high = 32-63); under AVX2 blocks of 32, for each k 16
 *   bytes (0-15, 16-31). Each build reads its ISA's layout (INT4_BLOCK; cpu_decode.py refuses a
 *   mismatch). scales_and_zeros bf16 [K/g, N, 2] with w = (q - 8) * scale + zero.
 *   int8 VNNI (only with int8_activations, AVX-512 VNNI builds): an int8 weight repacked once by
 *   cpu_decode.py into [N/16, K/4, 16, 4] bytes w + 128, and the same per-channel scales.
 *   int4 VNNI (the same condition): codes repacked once into [N/64, K/32, 8, 2, 16, 4] bytes, two
 *   channels per byte (int4_vnni_rows_t), scales block-major [N/64, K/g, 64, 2].
 *   int8 AVX2 (only with int8_activations, AVX2 builds): [N/8, K/4, 8, 4] signed bytes, the same scales.
 *   KV cache [L, num_blocks, block_size, Hkv, D] in fp32 or bf16 (the model dtype).
 * Activations are fp32 throughout and weights are widened in registers, except that with
 * int8_activations the int4 and int8 layers quantize their input to int8, one scale per act_group
 * (32-256) values.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4 = 3, W_INT8_VNNI = 4, W_INT8_AVX2 = 5, W_INT4_VNNI = 6, W_INT4_AVX2 = 7 };
#ifndef SLOTUNE_SCHEDULE
#define SLOTUNE_SCHEDULE static /* every work-sharing loop's schedule */
#endif
#define SPLIT_ROWS 2    /* batches of up to this many rows split int4 blocks over K (int4_vnni_span), */
#define SPLIT_THREADS 8 /* and attention tasks over keys (attend_span), with up to this many threads */

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
    const void *attn_out_norm, *mlp_out_norm; /* model dtype [D]: each sublayer's output normed (Gemma 3), or NULL */
    const float *cos_sin; /* [max_pos, rot_dim]: cos in the first half, sin in the second; NULL: no RoPE (NoPE) */
    int32_t window;       /* sliding window in keys (Mistral, Gemma 3's local layers), 0 = none */
} Layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab;
    int32_t dtype;    /* W_F32 or W_BF16: embedding, norms, KV cache */
    int32_t block_size;
    float eps, scale;
    int64_t num_blocks;
    const void *embed, *final_norm;
    const Layer *layers;
    Lin lm_head;
    void *k_cache, *v_cache;
    /* scratch, fp32, sized for max_batch rows by the caller */
    float *x, *res, *h, *qkv, *att, *gu, *act, *probs; /* probs: [max_batch * Hkv, G, max_ctx] */
    int32_t max_ctx;
    /* int8 activations for the integer kernels: codes [max_batch, max_k], scale and sum per 32 */
    int8_t *xq;
    float *xscale, *xsum;
    int32_t max_k;
    int32_t int8_activations; /* int4/int8 layers through the integer kernels (kernels.int8_activations) */
    int32_t *ctx_slots;       /* scratch [max_batch, max_ctx]: cache slot of each key of a row */
    float embed_scale;        /* embeddings times this (Gemma: sqrt(hidden)), 0 = none */
    int32_t rot_dim;          /* RoPE on each head's first rot_dim dims (Phi-3: part of the head) */
    int32_t gelu;             /* the MLP's gate: 1 = GeGLU with tanh GELU (Gemma), 0 = SwiGLU */
    int32_t act_group;        /* inputs per int8 activation scale: 32 (or 0), 64, 128 or 256 */
    float *split_part;        /* scratch [SPLIT_THREADS, SPLIT_THREADS, SPLIT_ROWS, 64]: a split block's K spans */
    int32_t *split_count;     /* scratch [SPLIT_THREADS], zero between calls: its spans done so far */
    float *split_att;         /* scratch [SPLIT_THREADS, SPLIT_THREADS, G, head_dim + 2]: a split task's key spans */
} Model;

/* Whether this span of a split block or task, now done, is the last of its T (count: its slot in
 * split_count); the last sees the others' partial sums (acquire) and zeroes the count, which the
 * next call reads only after the work-sharing loop's closing barrier. */
static inline int last_span(int32_t *count, int T) {
    if (__atomic_add_fetch(count, 1, __ATOMIC_ACQ_REL) < T) return 0; /* release: this span's sums */
    *count = 0;
    return 1;
}

/* 32-input slices per activation scale. Codes, scales and sums stay per slice (a group's slices
 * share its scale), so the int4 kernels read them as they are; the int8 kernels sum a group's
 * slices in int32 (at most 256 * 127 * 255 < 2^24: exact in float) and scale once per group. */
static inline int act_slices(const Model *md) { return md->act_group > 32 ? md->act_group / 32 : 1; }

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

#define INLINE static inline __attribute__((always_inline))

/* ---- vector layer: vf holds VL float32 lanes. The *n forms touch only the first n lanes
 * (n may exceed VL: then all of them); lanes past n load as 0 (or `fill`). ---- */

enum { ISA_AVX512 = 1, ISA_AVX2 = 2, ISA_INT8_VNNI = 4, ISA_INT8_AVX2 = 8, ISA_INT4_INT8ACT = 16, ISA_AMX = 32 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define VL 16
#define ISA_FLOAT ISA_AVX512
typedef __m512 vf;
#define vf_zero() _mm512_setzero_ps()
#define vf_set1(a) _mm512_set1_ps(a)
#define vf_load(p) _mm512_loadu_ps(p)
#define vf_store(p, v) _mm512_storeu_ps(p, v)
#define vf_add(a, b) _mm512_add_ps(a, b)
#define vf_sub(a, b) _mm512_sub_ps(a, b)
#define vf_mul(a, b) _mm512_mul_ps(a, b)
#define vf_div(a, b) _mm512_div_ps(a, b)
#define vf_max(a, b) _mm512_max_ps(a, b)
#define vf_min(a, b) _mm512_min_ps(a, b)
#define vf_fma(a, b, c) _mm512_fmadd_ps(a, b, c)   /* a * b + c */
#define vf_fms(a, b, c) _mm512_fmsub_ps(a, b, c)   /* a * b - c */
#define vf_fnma(a, b, c) _mm512_fnmadd_ps(a, b, c) /* c - a * b */
#define vf_hsum(v) _mm512_reduce_add_ps(v)
#define vf_hmax(v) _mm512_reduce_max_ps(v)
INLINE __mmask16 tail16(int n) { return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1); }
#define vf_loadn(p, n) _mm512_maskz_loadu_ps(tail16(n), p)
#define vf_loadn_or(p, n, fill) _mm512_mask_loadu_ps(_mm512_set1_ps(fill), tail16(n), p)
#define vf_storen(p, n, v) _mm512_mask_storeu_ps(p, tail16(n), v)
#define vf_maskz(n, v) _mm512_maskz_mov_ps(tail16(n), v)
INLINE vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
INLINE vf vf_load_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }

/* e^x: 2^n * e^f, n = round(x / ln 2), |f| <= ln(2) / 2, degree-6 Taylor (relative error < 4e-7).
 * Scalar expf calls were 7 of a 120 ms step at batch 64 (SiLU and softmax). */
INLINE vf vf_exp_poly(vf x, vf *n);
INLINE vf vf_exp(vf x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-103.0f));
    vf n;
    const vf p = vf_exp_poly(x, &n);
    return _mm512_scalef_ps(p, n);
}

/* r[i] = sum of the 16 lanes of a[i]: a transpose-and-add tree, 45 shuffles and adds for 16 sums
 * (a horizontal reduce per key cost ~8 dependent ops each). */
INLINE vf hsum_lanes(const vf a[VL]) {
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

/* n float32 -> bf16, round to nearest even (as f32_to_bf16) */
INLINE int put_bf16_vec(uint16_t *dst, const float *src, int n) {
    int i = 0;
#ifdef __AVX512BF16__
    for (; i + 16 <= n; i += 16) _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
#endif
    (void)dst, (void)src, (void)n;
    return i;
}

#elif defined(__AVX2__) && defined(__FMA__)
#define VL 8
#define ISA_FLOAT ISA_AVX2
typedef __m256 vf;
#define vf_zero() _mm256_setzero_ps()
#define vf_set1(a) _mm256_set1_ps(a)
#define vf_load(p) _mm256_loadu_ps(p)
#define vf_store(p, v) _mm256_storeu_ps(p, v)
#define vf_add(a, b) _mm256_add_ps(a, b)
#define vf_sub(a, b) _mm256_sub_ps(a, b)
#define vf_mul(a, b) _mm256_mul_ps(a, b)
#define vf_div(a, b) _mm256_div_ps(a, b)
#define vf_max(a, b) _mm256_max_ps(a, b)
#define vf_min(a, b) _mm256_min_ps(a, b)
#define vf_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_fms(a, b, c) _mm256_fmsub_ps(a, b, c)
#define vf_fnma(a, b, c) _mm256_fnmadd_ps(a, b, c)
INLINE float vf_hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
INLINE float vf_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
/* Partial vectors through vmaskmov only when n < 8: its store form is microcoded on AMD (~12
 * cycles), so the full vectors of a loop take plain loads and stores behind a predictable branch. */
INLINE __m256i tail8(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
INLINE vf vf_loadn(const float *p, int n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail8(n)); }
INLINE vf vf_loadn_or(const float *p, int n, float fill) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, tail8(n)), _mm256_castsi256_ps(tail8(n)));
}
INLINE void vf_storen(float *p, int n, vf v) {
    if (n >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, tail8(n), v);
}
INLINE vf vf_maskz(int n, vf v) { return n >= 8 ? v : _mm256_and_ps(_mm256_castsi256_ps(tail8(n)), v); }
INLINE vf vf_load_bf16(const uint16_t *p) { /* bf16 is the top half of a float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
INLINE vf vf_load_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }

INLINE vf vf_exp_poly(vf x, vf *n);
INLINE vf vf_exp(vf x) { /* as the AVX-512 one; 2^n in two factors, each a normal float for n >= -149 */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-103.0f));
    vf n;
    const vf p = vf_exp_poly(x, &n);
    const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1), bias = _mm256_set1_epi32(127);
    const vf s0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
    const vf s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s0), s1);
}

/* r[i] = sum of the 8 lanes of a[i]: two rounds of hadd, then the 128-bit halves added */
INLINE vf hsum_lanes(const vf a[VL]) {
    __m256 t[4], u[2];
    for (int i = 0; i < 4; i++) t[i] = _mm256_hadd_ps(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; i++) u[i] = _mm256_hadd_ps(t[2 * i], t[2 * i + 1]);
    return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

INLINE int put_bf16_vec(uint16_t *dst, const float *src, int n) { /* round to nearest even, NaN kept, as f32_to_bf16 */
    int i = 0;
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), inf = _mm256_set1_epi32(0x7f800000);
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(src + i));
        const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one))), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), inf);
        const __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        const __m256i b = _mm256_blendv_epi8(r, q, nan);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xd8)));
    }
    return i;
}
#else
#error "cpu_decode.c needs AVX-512 (F/BW/VL/DQ) or AVX2 with FMA"
#endif

INLINE vf vf_exp_poly(vf x, vf *n_out) { /* e^f with f = x - n ln 2 (two-part ln 2), n = round(x / ln 2) */
#if VL == 16
    const vf n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const vf n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
    vf f = vf_fnma(n, vf_set1(0.693145752f), x);
    f = vf_fnma(n, vf_set1(1.42860677e-6f), f);
    vf p = vf_set1(1.0f / 720);
    p = vf_fma(p, f, vf_set1(1.0f / 120));
    p = vf_fma(p, f, vf_set1(1.0f / 24));
    p = vf_fma(p, f, vf_set1(1.0f / 6));
    p = vf_fma(p, f, vf_set1(0.5f));
    p = vf_fma(p, f, vf_set1(1.0f));
    p = vf_fma(p, f, vf_set1(1.0f));
    *n_out = n;
    return p;
}

/* ---- matmul: out[m, n] = sum_k x[m, k] * W[n, k], rows m < M, channels [n0, n1) ---- */

#define MAX_ROWS 4 /* rows that share one pass over the weights */

/* Row counts and weight kinds are compile-time constants in each instantiation (see the
 * switches below), so the accumulators live in registers; generic loops spilled them. */
INLINE vf load_wv(const void *w, int kind, int64_t i) {
    if (kind == W_F32) return vf_load((const float *)w + i);
    if (kind == W_BF16) return vf_load_bf16((const uint16_t *)w + i);
    return vf_load_i8((const int8_t *)w + i);
}

INLINE float load1_w(const void *w, int kind, int64_t i) {
    return kind == W_INT8 ? (float)((const int8_t *)w)[i] : load_w(w, kind, i);
}

INLINE void dense_rows_t(const Lin *L, const float *x, int ldx, float *out, int ldo, const int M, const int kind,
                         int n0, int n1) {
    const int K = L->k;
    for (int n = n0; n < n1; n++) {
        const int64_t row = (int64_t)n * K;
        vf acc[MAX_ROWS];
        for (int m = 0; m < M; m++) acc[m] = vf_zero();
        int k = 0;
        for (; k + VL <= K; k += VL) {
            const vf w = load_wv(L->w, kind, row + k);
            for (int m = 0; m < M; m++) acc[m] = vf_fma(w, vf_load(x + (int64_t)m * ldx + k), acc[m]);
        }
        const float s = kind == W_INT8 ? bf16_to_f32(L->scales[n]) : 1.0f;
        for (int m = 0; m < M; m++) {
            float t = vf_hsum(acc[m]);
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

/* Scale and offset (zero - 8 * scale; zero itself when `centered`, for codes taken as q - 8) of
 * channels [c0, c0 + nv * VL) for the group starting at k0, one vector of VL channels each. The pack
 * stores (scale, zero) bf16 pairs [K/g, N, 2]. */
INLINE void int4_group_scales(const Lin *L, int c0, int k0, int nv, vf *sc, vf *off, const int centered) {
    const uint16_t *sz = L->scales + ((int64_t)(k0 / L->group) * L->n + c0) * 2;
    for (int j = 0; j < nv; j++) {
#if VL == 16
        const __m512i pairs = _mm512_loadu_si512((const void *)(sz + j * 32)); /* 16 x (scale, zero) */
        sc[j] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        const __m512 ze = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
#else
        const __m256i pairs = _mm256_loadu_si256((const __m256i *)(sz + j * 16)); /* 8 x (scale, zero) */
        sc[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
        const __m256 ze = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xffff0000u)));
#endif
        off[j] = centered ? ze : vf_fnma(vf_set1(8.0f), sc[j], ze);
    }
}

#if VL == 16
#define INT4_ROWS MAX_ROWS
#define INT4_BLOCK 64 /* channels per block of torch's int4 pack: its AVX-512 layout */
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
        int4_group_scales(L, b * 64, k0, 4, sc, off, 0);
        for (int j = 0; j < 4; j++)
            for (int m = 0; m < M; m++) {
                tot[m][j] = _mm512_fmadd_ps(sc[j], acc[m][j], tot[m][j]);
                tot[m][j] = _mm512_fmadd_ps(off[j], _mm512_set1_ps(sx[m]), tot[m][j]);
            }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + (int64_t)m * ldo + b * 64 + j * 16, tot[m][j]);
}
#else
#define INT4_ROWS 2
#define INT4_BLOCK 32 /* channels per block of torch's int4 pack: its AVX2 layout */
/* AVX2: torch packs int4 for its AVX2 kernels in blocks of 32 channels (for each k, 16 bytes: low
 * nibbles channels 0-15, high 16-31), so block `b` is 4 vectors of 8 channels; 2 rows' accumulators
 * fit the 16 ymm registers, and group sums go to `out`. Codes are taken as q - 8 (w = (q - 8) scale
 * + zero), so no large sum_k q x cancels against 8 sum_k x: 3x closer to float64 (SmolLM2's
 * down_proj, g128: 7e-6 vs 2.2e-5 max error), one subtraction per 8 weights, shared by the rows. */
INLINE void int4_block_rows_t(const Lin *L, const float *x, int ldx, float *out, int ldo, const int M, int b) {
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g;
    const uint8_t *p = (const uint8_t *)L->w + (int64_t)b * Kp * 16;
    const __m256i nib = _mm256_set1_epi32(0x0f), eight = _mm256_set1_epi32(8);
    for (int m = 0; m < M; m++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + (int64_t)m * ldo + b * 32 + j * 8, _mm256_setzero_ps());
    for (int k0 = 0; k0 < K; k0 += g) {
        const int k1 = k0 + g < K ? k0 + g : K;
        __m256 acc[INT4_ROWS][4];
        for (int m = 0; m < M; m++)
            for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
        for (int k = k0; k < k1; k++) {
            const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + (int64_t)k * 16)));
            const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + (int64_t)k * 16 + 8)));
            const __m256 w[4] = {
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v0, nib), eight)), /* channels 0-7 */
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(v1, nib), eight)), /* 8-15 */
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v0, 4), eight)),  /* 16-23 */
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(v1, 4), eight)),  /* 24-31 */
            };
            for (int m = 0; m < M; m++) {
                const __m256 xb = _mm256_set1_ps(x[(int64_t)m * ldx + k]);
                for (int j = 0; j < 4; j++) acc[m][j] = _mm256_fmadd_ps(w[j], xb, acc[m][j]);
            }
        }
        __m256 sc[4], off[4];
        int4_group_scales(L, b * 32, k0, 4, sc, off, 1);
        for (int m = 0; m < M; m++) {
            const float *xr = x + (int64_t)m * ldx;
            __m256 s = _mm256_setzero_ps();
            int k = k0;
            for (; k + 8 <= k1; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + k));
            float sx = vf_hsum(s);
            for (; k < k1; k++) sx += xr[k];
            float *o = out + (int64_t)m * ldo + b * 32;
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(o + j * 8, _mm256_fmadd_ps(off[j], _mm256_set1_ps(sx),
                                                            _mm256_fmadd_ps(sc[j], acc[m][j], _mm256_loadu_ps(o + j * 8))));
        }
    }
}
#endif

static void int4_block_rows(const Lin *L, const float *x, int ldx, float *out, int ldo, int M, int b) {
    switch (M) {
    case 1: int4_block_rows_t(L, x, ldx, out, ldo, 1, b); break;
#if INT4_ROWS == 2
    default: int4_block_rows_t(L, x, ldx, out, ldo, 2, b); break;
#else
    case 2: int4_block_rows_t(L, x, ldx, out, ldo, 2, b); break;
    case 3: int4_block_rows_t(L, x, ldx, out, ldo, 3, b); break;
    default: int4_block_rows_t(L, x, ldx, out, ldo, 4, b); break;
#endif
    }
}

#if VL == 16 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define HAVE_VNNI 1
/* int4 x int8 with VNNI (what ggml does for Q4 x Q8): activations quantized per 32 inputs
 * (symmetric int8, one float scale each), `vpdpbusd` multiplies 4 unsigned weight codes by 4
 * signed activation codes per lane and sums them into int32. `vpermt2b` gathers, from four
 * 32-byte rows k..k+3 of the CPU pack, each channel's 4 codes into one 32-bit lane in channel
 * order, so scales apply without permuting. 4x fewer vector ops per weight than widening to
 * float32, and the same work serves every row of the batch.
 *   sum_k w x = scale * sum_b dx_b * sum_{k in b} q_k qx_k + (zero - 8 scale) * sum_k x_k   */

/* One activation group of row m, the 32-input slices b0..b1-1 of xr -> codes, one scale (written for
 * each slice), and per slice a sum: of the float inputs when exact_sum (the int4 kernel's zero-point
 * term), else of the codes times the scale (the int8 kernel's correction for its unsigned weights,
 * exact in integers). */
static void quantize_group(const Model *md, const float *xr, int m, int b0, int b1, int exact_sum) {
    __m512 mx = _mm512_setzero_ps();
    for (int b = b0; b < b1; b++)
        mx = _mm512_max_ps(mx, _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xr + b * 32)), _mm512_abs_ps(_mm512_loadu_ps(xr + b * 32 + 16))));
    const float amax = _mm512_reduce_max_ps(mx);
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    const __m512 s = _mm512_set1_ps(inv);
    for (int b = b0; b < b1; b++) {
        const __m512 v0 = _mm512_loadu_ps(xr + b * 32), v1 = _mm512_loadu_ps(xr + b * 32 + 16);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
        int8_t *dst = md->xq + (int64_t)m * md->max_k + b * 32;
        _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(dst + 16), _mm512_cvtsepi32_epi8(q1));
        md->xscale[(int64_t)m * (md->max_k / 32) + b] = d;
        md->xsum[(int64_t)m * (md->max_k / 32) + b] =
            exact_sum ? _mm512_reduce_add_ps(_mm512_add_ps(v0, v1)) : d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    }
}

/* int8 weights x int8 activations, rows m0..m0+R-1 of C 16-channel blocks from c0. One vector of the
 * repacked weight holds 16 channels x 4 inputs, so `vpdpbusd` against 4 broadcast activation codes
 * accumulates 16 outputs with no horizontal reduction (the row-major layout needed one per output
 * and lost to float FMAs: 39 vs 32 ms for the LM head at 64 rows). Weights are stored + 128 since
 * vpdpbusd multiplies unsigned by signed bytes:
 *   sum_k w x = ws_n * sum_b dx_b (sum_{k in b} (w + 128) qx  -  128 sum_{k in b} qx)          */
INLINE void int8_vnni_tile_t(const Model *md, const Lin *L, float *out, int ldo, const int R, const int C, const int GS, int m0,
                              int c0) {
    const int nb = L->k / 32, ldq = md->max_k, lds = md->max_k / 32;
    const __m512i *w = (const __m512i *)((const uint8_t *)L->w + (int64_t)c0 * L->k * 16);
    const int64_t cs = L->k / 4; /* vectors per channel block */
    __m512 tot[8][2];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) tot[r][c] = _mm512_setzero_ps();
    for (int g0 = 0, gs = GS; g0 < nb; g0 += gs) {
        __m512i acc[8][2];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_si512();
        for (int b = g0; b < g0 + gs && b < nb; b++)
            for (int q = 0; q < 8; q++) {
                __m512i wv[2];
                for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_si512(w + c * cs + b * 8 + q);
                for (int r = 0; r < R; r++) {
                    const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(md->xq + (int64_t)(m0 + r) * ldq + b * 32 + 4 * q));
                    for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xb);
                }
            }
        for (int r = 0; r < R; r++) {
            const __m512 dx = _mm512_set1_ps(md->xscale[(int64_t)(m0 + r) * lds + g0]);
            for (int c = 0; c < C; c++) tot[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), dx, tot[r][c]);
        }
    }
    for (int r = 0; r < R; r++) {
        float corr = 0.0f;
        for (int b = 0; b < nb; b++) corr += md->xsum[(int64_t)(m0 + r) * lds + b];
        for (int c = 0; c < C; c++) {
            const __m512 t = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_set1_ps(corr), tot[r][c]);
            _mm512_storeu_ps(out + (int64_t)(m0 + r) * ldo + (c0 + c) * 16, _mm512_mul_ps(vf_load_bf16(L->scales + (c0 + c) * 16), t));
        }
    }
}

/* The tile with its slices per activation group as a constant for each group size: with a run-time
 * count the kernel read cold weights at batch 1 at 25.6 GB/s against 40.9 before groups (groups of
 * 32), and 1.09-1.21x slower than with the constant at groups of 64-256. */
#define INT8_VNNI_TILE(R, C, m0, c)                                                                   \
    do {                                                                                              \
        switch (act_slices(md)) {                                                                     \
        case 1: int8_vnni_tile_t(md, L, out, ldo, R, C, 1, m0, c); break;                             \
        case 2: int8_vnni_tile_t(md, L, out, ldo, R, C, 2, m0, c); break;                             \
        case 4: int8_vnni_tile_t(md, L, out, ldo, R, C, 4, m0, c); break;                             \
        case 8: int8_vnni_tile_t(md, L, out, ldo, R, C, 8, m0, c); break;                             \
        default: int8_vnni_tile_t(md, L, out, ldo, R, C, act_slices(md), m0, c); break;               \
        }                                                                                             \
    } while (0)
/* Rows m0..m0+M-1 (M <= 8) of one 16-channel block c. */
static void int8_vnni_rows(const Model *md, const Lin *L, float *out, int ldo, int M, int m0, int c) {
    switch (M) {
    case 1: INT8_VNNI_TILE(1, 1, m0, c); break;
    case 2: INT8_VNNI_TILE(2, 1, m0, c); break;
    case 3: INT8_VNNI_TILE(3, 1, m0, c); break;
    case 4: INT8_VNNI_TILE(4, 1, m0, c); break;
    case 5: INT8_VNNI_TILE(5, 1, m0, c); break;
    case 6: INT8_VNNI_TILE(6, 1, m0, c); break;
    case 7: INT8_VNNI_TILE(7, 1, m0, c); break;
    default: INT8_VNNI_TILE(8, 1, m0, c); break;
    }
}

/* Rows m..M-1 of one 16-channel block c, 8 per pass. */
static void int8_vnni_block(const Model *md, const Lin *L, float *out, int ldo, int m, int M, int c) {
    for (int r = m; r < M; r += 8) int8_vnni_rows(md, L, out, ldo, M - r < 8 ? M - r : 8, r, c);
}

/* Every row of channel blocks 2p and 2p + 1 (or 2p alone, the last of an odd count). From 16 rows up,
 * tiles of 4 rows x 2 blocks: each broadcast activation serves two vpdpbusd (1.06-1.13x at 16-64 rows
 * with weights from memory). Fewer rows go one block at a time, 8 rows per pass: one weight stream,
 * faster while the weights' memory traffic still limits (at 4 and 8 rows tiles measured slower). */
static void int8_vnni_pair(const Model *md, const Lin *L, float *out, int ldo, int M, int p) {
    const int c = 2 * p, two = c + 1 < L->n / 16;
    int m0 = 0;
    if (two && M >= 16)
        for (; m0 + 4 <= M; m0 += 4) INT8_VNNI_TILE(4, 2, m0, c);
    for (int cc = c; cc <= c + two; cc++) int8_vnni_block(md, L, out, ldo, m0, M, cc);
}

/* int4 codes repacked once for VNNI (cpu_decode.py _int4_quads): for each 64-channel block, each
 * 32-input slice is 8 quads x 2 vectors; byte 4c + i of vector v holds, for input 4q + i, channel
 * 16v + c in its low nibble and channel 32 + 16v + c in its high one. `and` with 0x0f gives channels
 * 0-15 / 16-31 as they are, `and` with 0xf0 gives 32-47 / 48-63 times 16, whose scale takes the 1/16:
 * no permute or shift per weight. Scales [N/64, K/g, 64, 2] bf16 (scale, zero), so a block is two
 * sequential streams. R rows at a time hold their 64 outputs in registers over all of K; the next
 * R rows read the block again from L1/L2.
 *   sum_k w x = scale * sum_b dx_b * sum_{k in b} q_k qx_k + (zero - 8 scale) * sum_k x_k   */
#define INT4_VNNI_ROWS 2 /* 3 or 4 measured slower: their accumulators spill */
/* Rows m0..m0+R-1 of block b over groups g0..g1-1 of K -> dst[r * ldd + 0..63]. */
INLINE void int4_vnni_rows_t(const Model *md, const Lin *L, float *dst, int ldd, const int R, int m0, int b, int g0, int g1) {
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g, ldq = md->max_k, lds = md->max_k / 32;
    const __m512i *w = (const __m512i *)((const uint8_t *)L->w + (int64_t)b * Kp * 32);
    const uint16_t *sz = L->scales + ((int64_t)b * (Kp / g) + g0) * 128;
    const int kend = g1 * g < K ? g1 * g : K;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), hi4 = _mm512_set1_epi8((char)0xf0);
    __m512 tot[INT4_VNNI_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) tot[r][j] = _mm512_setzero_ps();
    for (int k0 = g0 * g; k0 < kend; k0 += g, sz += 128) {
        const int k1 = k0 + g < K ? k0 + g : K;
        __m512 sc[4];
        for (int j = 0; j < 4; j++) /* scales: the high half of each (scale, zero) pair's low word */
            sc[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)(sz + j * 32)), 16));
        sc[2] = _mm512_mul_ps(sc[2], _mm512_set1_ps(1.0f / 16)); /* high nibbles come out times 16 */
        sc[3] = _mm512_mul_ps(sc[3], _mm512_set1_ps(1.0f / 16));
        float sx[INT4_VNNI_ROWS];
        for (int r = 0; r < R; r++) sx[r] = 0.0f;
        for (int kb = k0; kb < k1; kb += 32) {
            const __m512i *ws = w + (int64_t)(kb / 32) * 16;
            __m512i acc[INT4_VNNI_ROWS][4];
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_si512();
            for (int q = 0; q < 8; q++) {
                const __m512i v0 = _mm512_loadu_si512(ws + 2 * q), v1 = _mm512_loadu_si512(ws + 2 * q + 1);
                const __m512i wq[4] = {_mm512_and_si512(v0, lo4), _mm512_and_si512(v1, lo4), _mm512_and_si512(v0, hi4),
                                       _mm512_and_si512(v1, hi4)};
                for (int r = 0; r < R; r++) {
                    const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(md->xq + (int64_t)(m0 + r) * ldq + kb + 4 * q));
                    for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wq[j], xb);
                }
            }
            for (int r = 0; r < R; r++) {
                const __m512 dx = _mm512_set1_ps(md->xscale[(int64_t)(m0 + r) * lds + kb / 32]);
                sx[r] += md->xsum[(int64_t)(m0 + r) * lds + kb / 32];
                for (int j = 0; j < 4; j++) tot[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(sc[j], dx), _mm512_cvtepi32_ps(acc[r][j]), tot[r][j]);
            }
        }
        for (int j = 0; j < 4; j++) { /* zero - 8 scale, times each row's sum of x over the group */
            const __m512i pairs = _mm512_loadu_si512((const void *)(sz + j * 32));
            const __m512 ze = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
            const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)), ze);
            for (int r = 0; r < R; r++) tot[r][j] = _mm512_fmadd_ps(off, _mm512_set1_ps(sx[r]), tot[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(dst + (int64_t)r * ldd + j * 16, tot[r][j]);
}

/* One 64-channel block b of a repacked int4 weight for rows m..M-1. */
static void int4_vnni_block(const Model *md, const Lin *L, float *out, int ldo, int m, int M, int b) {
    const int ng = (L->k + L->group - 1) / L->group;
    for (int m0 = m; m0 < M; m0 += INT4_VNNI_ROWS) {
        float *dst = out + (int64_t)m0 * ldo + b * 64;
        if (M - m0 == 1) int4_vnni_rows_t(md, L, dst, ldo, 1, m0, b, 0, ng);
        else int4_vnni_rows_t(md, L, dst, ldo, INT4_VNNI_ROWS, m0, b, 0, ng);
    }
}

/* Span p of T of K for split block s (block b) of rows 0..M-1 (M <= SPLIT_ROWS): into split_part; the
 * span that finishes last sums the T spans into out. */
static void int4_vnni_span(const Model *md, const Lin *L, float *out, int ldo, int M, int s, int b, int p, int T) {
    const int ng = (L->k + L->group - 1) / L->group;
    float *part = md->split_part + (int64_t)(s * SPLIT_THREADS + p) * SPLIT_ROWS * 64;
    for (int m0 = 0; m0 < M; m0 += INT4_VNNI_ROWS) {
        if (M - m0 == 1) int4_vnni_rows_t(md, L, part + m0 * 64, 64, 1, m0, b, p * ng / T, (p + 1) * ng / T);
        else int4_vnni_rows_t(md, L, part + m0 * 64, 64, INT4_VNNI_ROWS, m0, b, p * ng / T, (p + 1) * ng / T);
    }
    if (!last_span(&md->split_count[s], T)) return;
    const float *first = md->split_part + (int64_t)s * SPLIT_THREADS * SPLIT_ROWS * 64;
    for (int m = 0; m < M; m++)
        for (int c = 0; c < 64; c += 16) {
            __m512 v = _mm512_setzero_ps();
            for (int q = 0; q < T; q++) v = _mm512_add_ps(v, _mm512_loadu_ps(first + ((int64_t)q * SPLIT_ROWS + m) * 64 + c));
            _mm512_storeu_ps(out + (int64_t)m * ldo + b * 64 + c, v);
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
/* AMX (Sapphire Rapids and later): `tdpbsud` multiplies a tile of 16 rows x 32 signed activation
 * codes by a tile of 8 quads x 16 channels x 4 unsigned weight bytes, the VNNI layouts as they are,
 * 8192 multiply-adds per instruction against 64 for one vpdpbusd. The int32 sums of each activation
 * group are the VNNI kernels' exactly and are scaled in the same order, so results are bit-identical;
 * only whole 16-row tiles go through AMX, the rest through VNNI.
 * Linux hands out tile state only on request (arch_prctl); amx_ok says whether it was granted. */
static int amx_ok = -1; /* -1: not asked yet; slotune_set_amx() turns it off and on for tests */
#define AMX_ROWS 16
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_cfg_t;

/* gcc's _tile_stored clobbers all memory, which sends the epilogue's register accumulators to the
 * stack; these name the 1 KiB they write and the 512 bytes of weights they read. */
#define TILE_STORE(t, p) __asm__ volatile("tilestored %%tmm" #t ", (%1,%2,1)" : "=m"(*(int32_t(*)[256])(p)) : "r"(p), "r"(64L))
#define TILE_LOAD_W(t, p) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(64L), "m"(*(const uint8_t(*)[512])(p)))

static int amx_request(void) {
    if (amx_ok < 0) amx_ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_ok;
}

/* Tile shapes, loaded by every thread before its share of a matmul. int8: tmm0-1 int32 sums (16 rows
 * x 16 channels), tmm2-3 activations (16 rows x 32 codes), tmm4-5 weights (8 quads x 64 bytes).
 * int4: tmm0-3 sums, tmm4 activations, tmm5-7 weights. */
static void amx_begin(int int4) {
    amx_cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 8, c.colsb[t] = 64; /* weights */
    for (int t = 0; t < (int4 ? 4 : 2); t++) c.rows[t] = 16; /* sums */
    for (int t = int4 ? 4 : 2; t < (int4 ? 5 : 4); t++) c.rows[t] = 16, c.colsb[t] = 32; /* activations */
    /* not _tile_loadconfig: gcc 12's names 8 of the 64 bytes it reads, so the rest can be dropped as dead stores */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

/* int8 weights, 16 rows from m0 x channel block c. Two sums take turns: activation group g + 1's
 * product is computed and stored while group g's is scaled, so the AMX unit and the vector epilogue
 * overlap, and each store has a group's time to land before it is read. */
#define INT8_AMX_ISSUE(S, g)                                                                               \
    do {                                                                                                    \
        _tile_zero(S);                                                                                      \
        for (int b_ = (g) * gs; b_ < ((g) + 1) * gs && b_ < nb; b_++) {                                     \
            for (int l = 0; l < 8; l++) _mm_prefetch((const char *)w + (int64_t)(b_ + 4) * 512 + 64 * l, _MM_HINT_T0); \
            if (b_ & 1) { /* odd slices in tmm3/5: a slice's loads need not wait for the last product */      \
                _tile_loadd(3, xq + b_ * 32, ldq);                                                          \
                TILE_LOAD_W(5, w + (int64_t)b_ * 512);                                                      \
                _tile_dpbsud(S, 3, 5);                                                                      \
            } else {                                                                                        \
                _tile_loadd(2, xq + b_ * 32, ldq);                                                          \
                TILE_LOAD_W(4, w + (int64_t)b_ * 512);                                                      \
                _tile_dpbsud(S, 2, 4);                                                                      \
            }                                                                                               \
        }                                                                                                   \
        TILE_STORE(S, acc[S]);                                                                              \
    } while (0)
/* The 16 rows' accumulators as named variables: gcc keeps an array of them on the stack. */
#define AMX_EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
/* Offsets of 16 rows' entries in the per-32 scales and sums, for gathers. */
static inline __m512i amx_row_offsets(int lds) {
    return _mm512_mullo_epi32(_mm512_set1_epi32(lds), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

/* Each row's sum of x over K, 16 rows at once (the weights' +128 correction): the same for every
 * channel block, so taken once per tile and matmul. */
static __m512 amx_row_sums(const Model *md, int K, int m0) {
    const int lds = md->max_k / 32;
    const __m512i srow = amx_row_offsets(lds);
    __m512 corr = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++) corr = _mm512_add_ps(corr, _mm512_i32gather_ps(srow, md->xsum + (int64_t)m0 * lds + b, 4));
    return corr;
}

static void int8_amx_tile(const Model *md, const Lin *L, float *out, int ldo, int m0, int c, const float *corr) {
    const int nb = L->k / 32, ldq = md->max_k, lds = md->max_k / 32, gs = act_slices(md), ng = (nb + gs - 1) / gs;
    const uint8_t *w = (const uint8_t *)L->w + (int64_t)c * L->k * 16;
    const int8_t *xq = md->xq + (int64_t)m0 * ldq;
    const __m512i srow = amx_row_offsets(lds);
    const float *xs = md->xscale + (int64_t)m0 * lds;
    int32_t acc[2][AMX_ROWS][16] __attribute__((aligned(64)));
    float dx[AMX_ROWS] __attribute__((aligned(64))); /* group g's scale of each row, gathered */
#define DECL(r) __m512 tot##r = _mm512_setzero_ps();
    AMX_EACH_ROW(DECL)
#undef DECL
#define FMA(r) tot##r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(acc[S_][r])), _mm512_set1_ps(dx[r]), tot##r);
#define INT8_AMX_SCALE(g)                                              \
    _mm512_store_ps(dx, _mm512_i32gather_ps(srow, xs + (g) * gs, 4)); \
    AMX_EACH_ROW(FMA)
    INT8_AMX_ISSUE(0, 0);
    for (int g = 0; g < ng; g += 2) {
        if (g + 1 < ng) INT8_AMX_ISSUE(1, g + 1);
        {
            enum { S_ = 0 };
            INT8_AMX_SCALE(g);
        }
        if (g + 1 < ng) {
            if (g + 2 < ng) INT8_AMX_ISSUE(0, g + 2);
            enum { S_ = 1 };
            INT8_AMX_SCALE(g + 1);
        }
    }
#undef INT8_AMX_SCALE
#undef FMA
    const __m512 ws = vf_load_bf16(L->scales + c * 16);
#define STORE(r)                                                                                                          \
    _mm512_storeu_ps(out + (int64_t)(m0 + r) * ldo + c * 16,                                                              \
                     _mm512_mul_ps(ws, _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_set1_ps(corr[r]), tot##r)));
    AMX_EACH_ROW(STORE)
#undef STORE
}

/* int4 weights: 64-channel block b for rows m0..m0+16*T-1 (T <= 4 tiles). Each 32-input slice is
 * unpacked once into four 8 x 64-byte weight tiles (the VNNI kernel's `and`s) and serves all T tiles. */
#define INT4_AMX_TILES 4
static void int4_amx_block(const Model *md, const Lin *L, float *out, int ldo, int T, int m0, int b) {
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g, ldq = md->max_k, lds = md->max_k / 32;
    const __m512i *w = (const __m512i *)((const uint8_t *)L->w + (int64_t)b * Kp * 32);
    const uint16_t *sz = L->scales + (int64_t)b * (Kp / g) * 128;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), hi4 = _mm512_set1_epi8((char)0xf0);
    uint8_t wt[4][8][64] __attribute__((aligned(64)));
    int32_t acc[4][AMX_ROWS][16] __attribute__((aligned(64)));
    float tot[INT4_AMX_TILES * AMX_ROWS][64] __attribute__((aligned(64)));
    float sx[INT4_AMX_TILES * AMX_ROWS];
    const int R = T * AMX_ROWS;
    memset(tot, 0, sizeof(float) * 64 * R);
    for (int k0 = 0; k0 < K; k0 += g, sz += 128) {
        const int k1 = k0 + g < K ? k0 + g : K;
        __m512 sc[4];
        for (int j = 0; j < 4; j++)
            sc[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)(sz + j * 32)), 16));
        sc[2] = _mm512_mul_ps(sc[2], _mm512_set1_ps(1.0f / 16));
        sc[3] = _mm512_mul_ps(sc[3], _mm512_set1_ps(1.0f / 16));
        for (int r = 0; r < R; r++) sx[r] = 0.0f;
        for (int kb = k0; kb < k1; kb += 32) {
            const __m512i *ws = w + (int64_t)(kb / 32) * 16;
            for (int q = 0; q < 8; q++) {
                const __m512i v0 = _mm512_loadu_si512(ws + 2 * q), v1 = _mm512_loadu_si512(ws + 2 * q + 1);
                _mm512_store_si512(wt[0][q], _mm512_and_si512(v0, lo4));
                _mm512_store_si512(wt[1][q], _mm512_and_si512(v1, lo4));
                _mm512_store_si512(wt[2][q], _mm512_and_si512(v0, hi4));
                _mm512_store_si512(wt[3][q], _mm512_and_si512(v1, hi4));
            }
            for (int t = 0; t < T; t++) {
                const int mt = m0 + t * AMX_ROWS;
                _tile_loadd(4, md->xq + (int64_t)mt * ldq + kb, ldq);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                TILE_LOAD_W(5, wt[0]);
                TILE_LOAD_W(6, wt[1]);
                TILE_LOAD_W(7, wt[2]);
                _tile_dpbsud(0, 4, 5);
                _tile_dpbsud(1, 4, 6);
                _tile_dpbsud(2, 4, 7);
                TILE_LOAD_W(5, wt[3]);
                _tile_dpbsud(3, 4, 5);
                TILE_STORE(0, acc[0]);
                TILE_STORE(1, acc[1]);
                TILE_STORE(2, acc[2]);
                TILE_STORE(3, acc[3]);
                for (int r = 0; r < AMX_ROWS; r++) {
                    const int rr = t * AMX_ROWS + r;
                    const __m512 dx = _mm512_set1_ps(md->xscale[(int64_t)(mt + r) * lds + kb / 32]);
                    sx[rr] += md->xsum[(int64_t)(mt + r) * lds + kb / 32];
                    for (int j = 0; j < 4; j++)
                        _mm512_store_ps(tot[rr] + 16 * j, _mm512_fmadd_ps(_mm512_mul_ps(sc[j], dx),
                                                                         _mm512_cvtepi32_ps(_mm512_load_si512(acc[j][r])),
                                                                         _mm512_load_ps(tot[rr] + 16 * j)));
                }
            }
        }
        for (int j = 0; j < 4; j++) {
            const __m512i pairs = _mm512_loadu_si512((const void *)(sz + j * 32));
            const __m512 ze = _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32((int)0xffff0000u)));
            const __m512 off = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)), ze);
            for (int r = 0; r < R; r++)
                _mm512_store_ps(tot[r] + 16 * j, _mm512_fmadd_ps(off, _mm512_set1_ps(sx[r]), _mm512_load_ps(tot[r] + 16 * j)));
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) _mm512_storeu_ps(out + (int64_t)(m0 + r) * ldo + b * 64 + j * 16, _mm512_load_ps(tot[r] + 16 * j));
}
#endif
#endif

#if VL == 8
#define HAVE_INT8_AVX2 1
/* An integer sum stays in its register, added to in order: without it gcc reassociates the unrolled
 * adds into a tree whose products spill to the stack (docs/design/kernels-cpu-decode.md). */
#define KEEP_SUM(v) __asm__("" : "+x"(v))
/* The integer kernels without VNNI (llama.cpp's AVX2 Q8/Q4 dots): activations quantized per 32
 * inputs as for VNNI; `vpmaddubsw` multiplies unsigned by signed bytes into int16 pair sums and
 * `vpmaddwd` by ones adds the pairs into int32. */

/* One activation group of row m -> codes, scale and sums as the VNNI build's quantize_group. */
static void quantize_group(const Model *md, const float *xg, int m, int b0, int b1, int exact_sum) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 mx = _mm256_setzero_ps();
    for (int i = b0 * 4; i < b1 * 4; i++) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xg + 8 * i), absmask));
    const float amax = vf_hmax(mx);
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int b = b0; b < b1; b++) {
        const float *xr = xg + b * 32;
        __m256 v[4];
        __m256i q[4];
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xr + 8 * i);
            q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)));
        }
        /* saturating packs work within 128-bit lanes: 4-byte groups come out q0[0:4] q1[0:4] q2[0:4]
         * q3[0:4] q0[4:8] ..., put back in order by one dword permute */
        const __m256i q8 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(md->xq + (int64_t)m * md->max_k + b * 32),
                            _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        md->xscale[(int64_t)m * (md->max_k / 32) + b] = d;
        md->xsum[(int64_t)m * (md->max_k / 32) + b] =
            exact_sum ? vf_hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])))
                      : d * vf_hsum(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
    }
}

/* int8 weights x int8 activations, 8 channels (block c) for rows m0..m0+M-1. One vector of the
 * repacked weight holds 8 channels x 4 inputs against 4 broadcast activation codes: 8 outputs with
 * no horizontal reduction, as the VNNI kernel. `vpmaddubsw` takes |w| and x with w's sign, so the
 * products never saturate (2 * 127 * 127 < 32767; w = -128 does not occur):
 *   sum_k w x = ws_n * sum_b dx_b sum_{k in b} w qx                                           */
#define INT8_ROWS 4
INLINE void int8_avx2_rows_t(const Model *md, const Lin *L, float *out, int ldo, const int M, int m0, int c) {
    const int nb = L->k / 32, ldq = md->max_k, lds = md->max_k / 32;
    const __m256i *w = (const __m256i *)((const int8_t *)L->w + (int64_t)c * L->k * 8);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 tot[INT8_ROWS];
    for (int m = 0; m < M; m++) tot[m] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i acc[INT8_ROWS];
        for (int m = 0; m < M; m++) acc[m] = _mm256_setzero_si256();
        for (int q = 0; q < 8; q++) {
            const __m256i wv = _mm256_loadu_si256(w + b * 8 + q), aw = _mm256_abs_epi8(wv);
            for (int m = 0; m < M; m++) {
                const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(md->xq + (int64_t)(m0 + m) * ldq + b * 32 + 4 * q));
                acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, wv)), ones));
            }
        }
        for (int m = 0; m < M; m++)
            tot[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(md->xscale[(int64_t)(m0 + m) * lds + b]), tot[m]);
    }
    const __m256 ws = vf_load_bf16(L->scales + c * 8);
    for (int m = 0; m < M; m++) _mm256_storeu_ps(out + (int64_t)(m0 + m) * ldo + c * 8, _mm256_mul_ps(ws, tot[m]));
}

static void int8_avx2_rows(const Model *md, const Lin *L, float *out, int ldo, int M, int c) {
    for (int m0 = 0; m0 < M; m0 += INT8_ROWS) {
        switch (M - m0 < INT8_ROWS ? M - m0 : INT8_ROWS) {
        case 1: int8_avx2_rows_t(md, L, out, ldo, 1, m0, c); break;
        case 2: int8_avx2_rows_t(md, L, out, ldo, 2, m0, c); break;
        case 3: int8_avx2_rows_t(md, L, out, ldo, 3, m0, c); break;
        default: int8_avx2_rows_t(md, L, out, ldo, 4, m0, c); break;
        }
    }
}

/* Of a 32-channel block's group, from its block-major (scale, zero) bf16 pairs, channels 8j..8j+7:
 * the scale (the high half of each pair's low word), and the offsets zero - 8 * scale of all 32. */
static inline __m256 int4_avx2_scale(const uint16_t *sz, int j) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(sz + j * 16)), 16));
}
static inline void int4_avx2_offsets(const uint16_t *sz, __m256 *off) {
    for (int j = 0; j < 4; j++) {
        const __m256i pairs = _mm256_loadu_si256((const __m256i *)(sz + j * 16));
        off[j] = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), int4_avx2_scale(sz, j), _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32((int)0xffff0000u))));
    }
}

/* int4 x int8: the codes are unsigned (0-15), so `vpmaddubsw` takes them and the activation codes
 * as they are, and the 8 quads of a 32-input slice add up in int16 (at most 8 * 2 * 15 * 127 =
 * 30480) before one `vpmaddwd`. Codes repacked once (cpu_decode.py _int4_quads): for each 32-channel
 * block, each 32-input slice is 8 quads x 2 vectors; byte 4c + i of vector v holds, for input
 * 4q + i, channel 8v + c in its low nibble and channel 16 + 8v + c in its high one, so an `and` and
 * a shift give each channel's 4 codes in one 32-bit lane, in channel order; scales block-major
 * [N/32, K/g, 32, 2], so a block is two sequential streams. One row: its 32 outputs in registers
 * over all of K; from 2 rows, int4_avx2_rows2 (docs/design/kernels-cpu-decode.md).
 *   sum_k w x = scale * sum_b dx_b * sum_{k in b} q_k qx_k + (zero - 8 scale) * sum_k x_k   */
static void int4_avx2_row(const Model *md, const Lin *L, float *out, int ldo, int m, int b) { /* row m, block b */
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g, lds = md->max_k / 32;
    const __m256i *w = (const __m256i *)((const uint8_t *)L->w + (int64_t)b * Kp * 16);
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t *xr = md->xq + (int64_t)m * md->max_k;
    const uint16_t *sz = L->scales + (int64_t)b * (Kp / g) * 64;
    __m256 tot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int k0 = 0; k0 < K; k0 += g, sz += 64) {
        const int k1 = k0 + g < K ? k0 + g : K;
        float sx = 0.0f;
        for (int kb = k0; kb < k1; kb += 32) {
            const __m256i *ws = w + (int64_t)(kb / 32) * 16;
            __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int q = 0; q < 8; q++) {
                const __m256i v0 = _mm256_loadu_si256(ws + 2 * q), v1 = _mm256_loadu_si256(ws + 2 * q + 1);
                const __m256i xb = _mm256_set1_epi32(*(const int32_t *)(xr + kb + 4 * q));
                acc[0] = _mm256_add_epi16(acc[0], _mm256_maddubs_epi16(_mm256_and_si256(v0, nib), xb));
                acc[1] = _mm256_add_epi16(acc[1], _mm256_maddubs_epi16(_mm256_and_si256(v1, nib), xb));
                acc[2] = _mm256_add_epi16(acc[2], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), nib), xb));
                acc[3] = _mm256_add_epi16(acc[3], _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), nib), xb));
                for (int j = 0; j < 4; j++) KEEP_SUM(acc[j]);
            }
            const __m256 dx = _mm256_set1_ps(md->xscale[(int64_t)m * lds + kb / 32]);
            sx += md->xsum[(int64_t)m * lds + kb / 32];
            for (int j = 0; j < 4; j++)
                tot[j] = _mm256_fmadd_ps(_mm256_mul_ps(int4_avx2_scale(sz, j), dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[j], ones)), tot[j]);
        }
        __m256 off[4];
        int4_avx2_offsets(sz, off);
        for (int j = 0; j < 4; j++) tot[j] = _mm256_fmadd_ps(off[j], _mm256_set1_ps(sx), tot[j]);
    }
    for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + (int64_t)m * ldo + b * 32 + j * 8, tot[j]);
}

/* Rows m and m + 1 of block b: each weight vector unpacked once for both rows (1.1-1.4x one row at a
 * time). Their 2 x 4 sums take the registers, so the float totals add up in `out`, in the same order
 * as int4_avx2_row's. */
static void int4_avx2_rows2(const Model *md, const Lin *L, float *out, int ldo, int m, int b) {
    const int K = L->k, g = L->group, Kp = (K + g - 1) / g * g, lds = md->max_k / 32;
    const __m256i *w = (const __m256i *)((const uint8_t *)L->w + (int64_t)b * Kp * 16);
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const int8_t *xr[2] = {md->xq + (int64_t)m * md->max_k, md->xq + (int64_t)(m + 1) * md->max_k};
    const float *xs[2] = {md->xscale + (int64_t)m * lds, md->xscale + (int64_t)(m + 1) * lds};
    const float *xt[2] = {md->xsum + (int64_t)m * lds, md->xsum + (int64_t)(m + 1) * lds};
    float *o[2] = {out + (int64_t)m * ldo + b * 32, out + (int64_t)(m + 1) * ldo + b * 32};
    const uint16_t *sz = L->scales + (int64_t)b * (Kp / g) * 64;
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(o[r] + j * 8, _mm256_setzero_ps());
    for (int k0 = 0; k0 < K; k0 += g, sz += 64) {
        const int k1 = k0 + g < K ? k0 + g : K;
        float sx[2] = {0.0f, 0.0f};
        for (int kb = k0; kb < k1; kb += 32) {
            const __m256i *ws = w + (int64_t)(kb / 32) * 16;
            __m256i a[4], c[4];
            for (int j = 0; j < 4; j++) a[j] = c[j] = _mm256_setzero_si256();
            for (int q = 0; q < 8; q++) {
                const __m256i v0 = _mm256_loadu_si256(ws + 2 * q), v1 = _mm256_loadu_si256(ws + 2 * q + 1);
                const __m256i wq[4] = {_mm256_and_si256(v0, nib), _mm256_and_si256(v1, nib),
                                       _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib), _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib)};
                const __m256i x0 = _mm256_set1_epi32(*(const int32_t *)(xr[0] + kb + 4 * q));
                for (int j = 0; j < 4; j++) a[j] = _mm256_add_epi16(a[j], _mm256_maddubs_epi16(wq[j], x0));
                const __m256i x1 = _mm256_set1_epi32(*(const int32_t *)(xr[1] + kb + 4 * q));
                for (int j = 0; j < 4; j++) c[j] = _mm256_add_epi16(c[j], _mm256_maddubs_epi16(wq[j], x1));
                for (int j = 0; j < 4; j++) {
                    KEEP_SUM(a[j]);
                    KEEP_SUM(c[j]);
                }
            }
            const __m256 d0 = _mm256_set1_ps(xs[0][kb / 32]), d1 = _mm256_set1_ps(xs[1][kb / 32]);
            sx[0] += xt[0][kb / 32];
            sx[1] += xt[1][kb / 32];
            for (int j = 0; j < 4; j++) {
                const __m256 sc = int4_avx2_scale(sz, j);
                _mm256_storeu_ps(o[0] + j * 8, _mm256_fmadd_ps(_mm256_mul_ps(sc, d0), _mm256_cvtepi32_ps(_mm256_madd_epi16(a[j], ones)),
                                                               _mm256_loadu_ps(o[0] + j * 8)));
                _mm256_storeu_ps(o[1] + j * 8, _mm256_fmadd_ps(_mm256_mul_ps(sc, d1), _mm256_cvtepi32_ps(_mm256_madd_epi16(c[j], ones)),
                                                               _mm256_loadu_ps(o[1] + j * 8)));
            }
        }
        __m256 off[4];
        int4_avx2_offsets(sz, off);
        for (int r = 0; r < 2; r++)
            for (int j = 0; j < 4; j++)
                _mm256_storeu_ps(o[r] + j * 8, _mm256_fmadd_ps(off[j], _mm256_set1_ps(sx[r]), _mm256_loadu_ps(o[r] + j * 8)));
    }
}

static void int4_avx2_block(const Model *md, const Lin *L, float *out, int ldo, int M, int b) {
    int m = 0;
    for (; m + 2 <= M; m += 2) int4_avx2_rows2(md, L, out, ldo, m, b);
    if (m < M) int4_avx2_row(md, L, out, ldo, m, b);
}
#endif

/* Per-op wall time of the step's ops (bench/engine/profile_step.py), compiled in with
 * -DSLOTUNE_PROFILE only. Every op ends at its work-sharing loop's barrier, so the master thread's
 * clock between two marks is that op's time on the slowest thread, barrier included. */
enum { P_EMBED, P_NORM, P_QUANT, P_QKV, P_ROPE_KV, P_ATTN, P_O, P_GATE_UP, P_GATE, P_DOWN, P_LM_HEAD, P_COUNT };
#ifdef SLOTUNE_PROFILE
static double prof_sum[P_COUNT], prof_last;
#define PROF(i)                                        \
    do {                                               \
        _Pragma("omp master") {                        \
            const double t_ = omp_get_wtime();         \
            prof_sum[i] += t_ - prof_last;             \
            prof_last = t_;                            \
        }                                              \
    } while (0)
/* seconds per op since the last call, then zeroed; returns P_COUNT */
int slotune_profile(double *out) {
    for (int i = 0; i < P_COUNT; i++) out[i] = prof_sum[i], prof_sum[i] = 0.0;
    return P_COUNT;
}
#ifdef HAVE_VNNI
/* The machine's vpdpbusd ceiling, MACs per second: 16 independent chains per thread, `iters` each. */
double slotune_vnni_peak(int64_t iters, int num_threads) {
    const double t0 = omp_get_wtime();
    int32_t sink = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : sink)
    {
        __m512i a[16];
        const __m512i w = _mm512_set1_epi32(0x01010101), x = _mm512_set1_epi32(0x01fe01fe);
        for (int j = 0; j < 16; j++) a[j] = _mm512_set1_epi32(j);
        for (int64_t i = 0; i < iters; i++)
            for (int j = 0; j < 16; j++) a[j] = _mm512_dpbusd_epi32(a[j], w, x);
        for (int j = 0; j < 16; j++) sink += _mm512_reduce_add_epi32(a[j]);
    }
    const double dt = omp_get_wtime() - t0;
    return sink == 42 ? 0.0 : (double)iters * 16 * 64 * num_threads / dt; /* sink read: the chains are kept */
}
#endif
#ifdef HAVE_AMX
/* The machine's tdpbsud ceiling, MACs per second: 2 independent sums per thread over tiles in
 * registers (the int8 kernel's shapes), `iters` each; 0 without AMX. */
double slotune_amx_peak(int64_t iters, int num_threads) {
    if (amx_request() <= 0) return 0.0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(num_threads)
    {
        static const int8_t zeros[AMX_ROWS * 64];
        amx_begin(0);
        _tile_loadd(2, zeros, 32);
        _tile_loadd(4, zeros, 64);
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t i = 0; i < iters; i++) {
            _tile_dpbsud(0, 2, 4);
            _tile_dpbsud(1, 2, 4);
        }
        _tile_release();
    }
    return (double)iters * 2 * AMX_ROWS * 16 * 32 * num_threads / (omp_get_wtime() - t0);
}
#endif
#else
#define PROF(i) ((void)0)
#endif

/* How a matmul by L takes its inputs: 0 as float32, else as int8 codes (quantize_group) with the
 * float sums (2, the int4 kernels) or the codes' (1, the int8 kernels). */
static int act_codes(const Lin *L) {
#ifdef HAVE_VNNI
    if (L->kind == W_INT8_VNNI) return 1;
    if (L->kind == W_INT4_VNNI) return 2;
#endif
#ifdef HAVE_INT8_AVX2
    if (L->kind == W_INT8_AVX2) return 1;
    if (L->kind == W_INT4_AVX2) return 2;
#endif
    (void)L;
    return 0;
}

/* Row m of x [., K] as L's input codes, when L takes codes: the op that writes a row quantizes it in
 * the same task, a barrier and a pass fewer than quantize_rows after it. */
static void quantize_row(const Model *md, const Lin *L, const float *xr, int m) {
#if defined(HAVE_VNNI) || defined(HAVE_INT8_AVX2)
    const int codes = act_codes(L), nb = codes ? L->k / 32 : 0, gs = act_slices(md);
    for (int b0 = 0; b0 < nb; b0 += gs) quantize_group(md, xr, m, b0, b0 + gs < nb ? b0 + gs : nb, codes == 2);
#else
    (void)md, (void)L, (void)xr, (void)m;
#endif
}

#if defined(HAVE_VNNI) || defined(HAVE_INT8_AVX2)
/* x [M, K] -> L's input codes, one task per (row, activation group). */
static void quantize_rows(const Model *md, const Lin *L, const float *x, int ldx, int M) {
    const int nb = L->k / 32, gs = act_slices(md), ng = (nb + gs - 1) / gs;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
    for (int t = 0; t < M * ng; t++) {
        const int m = t / ng, b0 = t % ng * gs;
        quantize_group(md, x + (int64_t)m * ldx, m, b0, b0 + gs < nb ? b0 + gs : nb, act_codes(L) == 2);
    }
}
#endif

/* out[M, N] = x[M, K] @ W^T, shared by the threads of the enclosing parallel region; `coded`: the
 * op that wrote x already quantized it for L (quantize_row). */
static void matmul_nobias(const Model *md, const Lin *L, const float *x, int ldx, float *out, int ldo, int M, int coded) {
    (void)md; /* read by the integer kernels only */
#if defined(HAVE_VNNI) || defined(HAVE_INT8_AVX2)
    if (act_codes(L) && !coded) {
        quantize_rows(md, L, x, ldx, M);
        PROF(P_QUANT);
    }
#else
    (void)coded;
#endif
#ifdef HAVE_VNNI
    if (L->kind == W_INT8_VNNI) { /* repacked (cpu_decode.py) only with int8_activations, K % 32 == 0, N % 16 == 0 */
#ifdef HAVE_AMX
        if (M >= AMX_ROWS && amx_ok > 0) {
            const int tiles = M / AMX_ROWS;
            float corr[tiles][AMX_ROWS] __attribute__((aligned(64)));
            for (int t = 0; t < tiles; t++) _mm512_store_ps(corr[t], amx_row_sums(md, L->k, t * AMX_ROWS));
            amx_begin(0);
#pragma omp for schedule(SLOTUNE_SCHEDULE)
            for (int c = 0; c < L->n / 16; c++) {
                for (int t = 0; t < tiles; t++) int8_amx_tile(md, L, out, ldo, t * AMX_ROWS, c, corr[t]);
                int8_vnni_block(md, L, out, ldo, tiles * AMX_ROWS, M, c);
            }
            _tile_release();
            return;
        }
#endif
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int p = 0; p < (L->n / 16 + 1) / 2; p++) int8_vnni_pair(md, L, out, ldo, M, p);
        return;
    }
    if (L->kind == W_INT4_VNNI) { /* repacked (cpu_decode.py) only with int8_activations, K % 32 == 0, g % 32 == 0 */
#ifdef HAVE_AMX
        if (M >= AMX_ROWS && amx_ok > 0) {
            const int tiles = M / AMX_ROWS, m1 = tiles * AMX_ROWS;
            amx_begin(1);
#pragma omp for schedule(SLOTUNE_SCHEDULE)
            for (int b = 0; b < L->n / 64; b++) {
                for (int t = 0; t < tiles; t += INT4_AMX_TILES)
                    int4_amx_block(md, L, out, ldo, tiles - t < INT4_AMX_TILES ? tiles - t : INT4_AMX_TILES, t * AMX_ROWS, b);
                int4_vnni_block(md, L, out, ldo, m1, M, b);
            }
            _tile_release();
            return;
        }
#endif
        /* A batch of 1-2 rows whose blocks do not share evenly among the threads (o and down: 9 blocks
         * on 2 threads) cuts each of the last nb % T into T spans of K, so each thread reads as many bytes. */
        const int nb = L->n / 64, T = omp_get_num_threads();
        const int rest = M <= SPLIT_ROWS && T > 1 && T <= SPLIT_THREADS ? nb % T : 0, full = nb - rest;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int t = 0; t < full + rest * T; t++) {
            if (t < full) int4_vnni_block(md, L, out, ldo, 0, M, t);
            else int4_vnni_span(md, L, out, ldo, M, (t - full) / T, full + (t - full) / T, (t - full) % T, T);
        }
        return;
    }
#endif
#ifdef HAVE_INT8_AVX2
    if (L->kind == W_INT8_AVX2) { /* repacked (cpu_decode.py) only with int8_activations, K % 32 == 0, N % 8 == 0 */
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int c = 0; c < L->n / 8; c++) int8_avx2_rows(md, L, out, ldo, M, c);
        return;
    }
    if (L->kind == W_INT4_AVX2) { /* repacked (cpu_decode.py) only with int8_activations, K % 32 == 0, g % 32 == 0 */
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int b = 0; b < L->n / INT4_BLOCK; b++) int4_avx2_block(md, L, out, ldo, M, b);
        return;
    }
#endif
    if (L->kind == W_INT4) {
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int b = 0; b < L->n / INT4_BLOCK; b++)
            for (int m0 = 0; m0 < M; m0 += INT4_ROWS)
                int4_block_rows(L, x + (int64_t)m0 * ldx, ldx, out + (int64_t)m0 * ldo, ldo,
                                M - m0 < INT4_ROWS ? M - m0 : INT4_ROWS, b);
        return;
    }
    const int chunk = 16, nc = (L->n + chunk - 1) / chunk;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
    for (int c = 0; c < nc; c++) {
        const int n1 = (c + 1) * chunk < L->n ? (c + 1) * chunk : L->n;
        for (int m0 = 0; m0 < M; m0 += MAX_ROWS)
            dense_rows(L, x + (int64_t)m0 * ldx, ldx, out + (int64_t)m0 * ldo, ldo,
                       M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS, c * chunk, n1);
    }
}

/* ---- pointwise ---- */

/* p[0:n] = softmax(p[0:n]) in place; with `stat`, exp(p - max) left unnormalized and (max, sum) in stat. */
static void softmax(float *p, int n, float *stat) {
    vf mx = vf_set1(-INFINITY);
    for (int j = 0; j < n; j += VL) mx = vf_max(mx, vf_loadn_or(p + j, n - j, -INFINITY));
    const vf m = vf_set1(vf_hmax(mx));
    vf sum = vf_zero();
    for (int j = 0; j < n; j += VL) {
        const vf e = vf_maskz(n - j, vf_exp(vf_sub(vf_loadn(p + j, n - j), m)));
        vf_storen(p + j, n - j, e);
        sum = vf_add(sum, e);
    }
    if (stat) {
        stat[0] = vf_hmax(mx), stat[1] = vf_hsum(sum);
        return;
    }
    const vf inv = vf_set1(1.0f / vf_hsum(sum));
    for (int j = 0; j < n; j += VL) vf_storen(p + j, n - j, vf_mul(vf_loadn(p + j, n - j), inv));
}

/* act[m, :] = gate(gu[m, :I]) * gu[m, I:]: silu (SwiGLU), or with `gelu` tanh-approximate GELU
 * (GeGLU), tanh(y) as 1 - 2 / (e^2y + 1); quantized for `next` (quantize_row) a group per task. */
static void gate_mul(const Model *md, const float *gu, float *act, int M, int I, int gelu, const Lin *next) {
    const int codes = act_codes(next), span = codes ? act_slices(md) * 32 : VL, nc = (I + span - 1) / span;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
    for (int t = 0; t < M * nc; t++) {
        const int m = t / nc, i0 = (t % nc) * span, i1 = i0 + span < I ? i0 + span : I;
        for (int i = i0; i < i1; i += VL) {
            const vf g = vf_loadn(gu + (int64_t)m * 2 * I + i, I - i);
            const vf u = vf_loadn(gu + (int64_t)m * 2 * I + I + i, I - i);
            vf a;
            if (gelu) {
                const vf y = vf_mul(vf_set1(0.7978845608f), vf_fma(vf_mul(vf_set1(0.044715f), vf_mul(g, g)), g, g));
                const vf th = vf_sub(vf_set1(1.0f), vf_div(vf_set1(2.0f), vf_add(vf_exp(vf_add(y, y)), vf_set1(1.0f))));
                a = vf_mul(vf_mul(vf_set1(0.5f), g), vf_add(vf_set1(1.0f), th));
            } else {
                a = vf_div(g, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), g))));
            }
            vf_storen(act + (int64_t)m * I + i, I - i, vf_mul(a, u));
        }
#if defined(HAVE_VNNI) || defined(HAVE_INT8_AVX2)
        if (codes) quantize_group(md, act + (int64_t)m * I, m, i0 / 32, i1 / 32, codes == 2);
#endif
    }
}

/* h[0:D] = v * rsqrt(ss / D + eps) * w, ss the sum of v's squares; in place when h == v. */
static void norm_scale(const Model *md, const void *w, const float *v, float *h, float ss) {
    const int D = md->hidden, Dv = D / VL * VL;
    const float r = 1.0f / sqrtf(ss / D + md->eps);
    for (int i = 0; i < Dv; i += VL) {
        const vf wv = md->dtype == W_F32 ? vf_load((const float *)w + i) : vf_load_bf16((const uint16_t *)w + i);
        vf_store(h + i, vf_mul(vf_mul(vf_load(v + i), vf_set1(r)), wv));
    }
    for (int i = Dv; i < D; i++) h[i] = v[i] * r * load_w(w, md->dtype, i);
}

/* x = rms_norm(x) * w in place: a sublayer's output normed before the residual add (Gemma 3). */
static void rms_norm_rows(const Model *md, const void *w, float *x, int M) {
    const int D = md->hidden, Dv = D / VL * VL;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
    for (int m = 0; m < M; m++) {
        float *xr = x + (int64_t)m * D;
        vf acc = vf_zero();
        for (int i = 0; i < Dv; i += VL) acc = vf_fma(vf_load(xr + i), vf_load(xr + i), acc);
        float ss = vf_hsum(acc);
        for (int i = Dv; i < D; i++) ss += xr[i] * xr[i];
        norm_scale(md, w, xr, xr, ss);
    }
}

/* h = rms_norm(x + res) * w; res = x + res (or x when first); each row quantized for `next` (NULL:
 * none) as it is written. Rows split over threads. */
static void add_rms_norm(const Model *md, const void *w, float *x, float *res, float *h, int M, int first, const Lin *next) {
    const int D = md->hidden, Dv = D / VL * VL;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
    for (int m = 0; m < M; m++) {
        float *xr = x + (int64_t)m * D, *rr = res + (int64_t)m * D;
        vf acc = vf_zero();
        for (int i = 0; i < Dv; i += VL) {
            const vf v = first ? vf_load(xr + i) : vf_add(vf_load(xr + i), vf_load(rr + i));
            vf_store(rr + i, v);
            acc = vf_fma(v, v, acc);
        }
        float ss = vf_hsum(acc);
        for (int i = Dv; i < D; i++) {
            rr[i] = first ? xr[i] : xr[i] + rr[i];
            ss += rr[i] * rr[i];
        }
        norm_scale(md, w, rr, h + (int64_t)m * D, ss);
        if (next) quantize_row(md, next, h + (int64_t)m * D, m);
    }
}

/* v[0:n] = rms_norm(v) * w, in place (one head of q or k). */
static void head_rms_norm(float *v, const void *w, int dtype, int n, float eps) {
    vf ss = vf_zero();
    for (int i = 0; i < n; i += VL) {
        const vf x = vf_load(v + i); /* n % 16 == 0 (cpu_decode.py checks head_dim) */
        ss = vf_fma(x, x, ss);
    }
    const vf r = vf_set1(1.0f / sqrtf(vf_hsum(ss) / n + eps));
    for (int i = 0; i < n; i += VL) {
        const vf wv = dtype == W_F32 ? vf_load((const float *)w + i) : vf_load_bf16((const uint16_t *)w + i);
        vf_store(v + i, vf_mul(vf_mul(vf_load(v + i), r), wv));
    }
}

static void rotate(float *v, const float *cs, int half) { /* rotate-half RoPE: cos in cs[:half], sin in cs[half:] */
    for (int i = 0; i < half; i += VL) {
        const int n = half - i;
        const vf a = vf_loadn(v + i, n), b = vf_loadn(v + i + half, n);
        const vf c = vf_loadn(cs + i, n), sn = vf_loadn(cs + i + half, n);
        vf_storen(v + i, n, vf_fms(a, c, vf_mul(b, sn)));
        vf_storen(v + i + half, n, vf_fma(b, c, vf_mul(a, sn)));
    }
}

static inline void put_kv(void *cache, int dtype, int64_t off, const float *src, int n) {
    if (dtype == W_F32) {
        memcpy((float *)cache + off, src, (size_t)n * sizeof(float));
        return;
    }
    int i = put_bf16_vec((uint16_t *)cache + off, src, n);
    for (; i < n; i++) ((uint16_t *)cache)[off + i] = f32_to_bf16(src[i]);
}

/* The cache rows of one head are a few hundred bytes apart and scattered over pages: the hardware
 * prefetcher missed them and every row cost a memory latency (attention was 1.4 of a 7 ms step). */
static inline void prefetch_row(const void *cache, int dtype, int64_t off, int n) {
    const char *p = (const char *)cache + off * (dtype == W_F32 ? 4 : 2);
    for (int b = 0; b < n * (dtype == W_F32 ? 4 : 2); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

INLINE vf load_kv(const void *cache, int dtype, int64_t off) {
    return dtype == W_F32 ? vf_load((const float *)cache + off) : vf_load_bf16((const uint16_t *)cache + off);
}

#define ATT_CHUNK VL /* keys scored together: one hsum_lanes */
#define ATT_PF 32    /* keys ahead that K rows are prefetched (64 measured slower) */
/* V accumulation: ATT_DV vectors of head dims x ATT_G query heads in registers (AVX-512: 64 dims x
 * 4 heads in 16 of 32 zmm; AVX2: 16 dims x 4 heads in 8 of 16 ymm, V rows re-read from L1 per 16 dims) */
#if VL == 16
#define ATT_DV 4
#else
#define ATT_DV 2
#endif
#define ATT_G 4
/* Scores of G query heads q [G, NV * VL] against a chunk's K rows kt [ATT_CHUNK, NV * VL] (rows past
 * cn zeroed) -> p[g * max_ctx + c ..]. NV, the head's vectors, is a constant where the caller can
 * make it one: the 16 sums then stay in registers (with a runtime count gcc kept them on the stack). */
INLINE void att_scores_t(const Model *md, const float *q, const float *kt, float *p, int G, int c, int cn, const int NV) {
    const int hd = NV * VL;
    for (int g = 0; g < G; g++) {
        vf acc[ATT_CHUNK];
        for (int jj = 0; jj < ATT_CHUNK; jj++) {
            acc[jj] = vf_zero();
            for (int v = 0; v < NV; v++) acc[jj] = vf_fma(vf_load(q + g * hd + v * VL), vf_load(kt + jj * hd + v * VL), acc[jj]);
        }
        vf_storen(p + g * md->max_ctx + c, cn, vf_mul(hsum_lanes(acc), vf_set1(md->scale)));
    }
}

/* o[g0 + g, d0 + v * VL ..] = sum_j p[g0 + g, j] V[j, d0 + v * VL ..] for GN heads x VN vectors held in
 * registers; constants where the caller can make them (as att_scores_t). */
INLINE void att_values_t(const Model *md, const float *p, float *o, int64_t base, const int32_t *cslot, int j0, int n, int d0,
                         int g0, const int GN, const int VN) {
    const int hd = md->head_dim, row = md->num_kv_heads * hd;
    vf acc[ATT_G][ATT_DV];
    for (int g = 0; g < GN; g++)
        for (int v = 0; v < VN; v++) acc[g][v] = vf_zero();
    for (int jj = 0; jj < n; jj++) {
        const int64_t off = base + (int64_t)cslot[j0 + jj] * row + d0;
        vf vr[ATT_DV];
        for (int v = 0; v < VN; v++) vr[v] = load_kv(md->v_cache, md->dtype, off + v * VL);
        for (int g = 0; g < GN; g++) {
            const vf pj = vf_set1(p[(g0 + g) * md->max_ctx + jj]);
            for (int v = 0; v < VN; v++) acc[g][v] = vf_fma(pj, vr[v], acc[g][v]);
        }
    }
    for (int g = 0; g < GN; g++)
        for (int v = 0; v < VN; v++) vf_store(o + (g0 + g) * hd + d0 + v * VL, acc[g][v]);
}

/* One (sequence, kv head) task: its G query heads q [G, hd] over keys j0..L-1 of the paged cache
 * -> o [G, hd]. Keys go ATT_CHUNK at a time: the chunk's K rows are widened to float32 once into kt,
 * each query head's scores come out of one hsum_lanes; then softmax; then V with the output held in
 * registers. p: [G, max_ctx] scratch. The rows are a few hundred bytes apart, out of reach of the
 * hardware prefetcher: K is prefetched ATT_PF keys ahead, V while K is read. */
static void attend(const Model *md, const float *q, float *o, float *p, float *kt, int64_t base, const int32_t *cslot,
                   int kh, int j0, int L, float *stats) {
    const int hd = md->head_dim, G = md->num_heads / md->num_kv_heads, row = md->num_kv_heads * hd;
    const int64_t kb = base + (int64_t)kh * hd;
    for (int j = j0; j < j0 + ATT_PF && j < L; j++) prefetch_row(md->k_cache, md->dtype, kb + (int64_t)cslot[j] * row, hd);
    const int nv = hd / VL, n = L - j0; /* hd % 16 == 0 (checked by cpu_decode.py) */
    for (int c = 0; c < n; c += ATT_CHUNK) {
        const int cn = n - c < ATT_CHUNK ? n - c : ATT_CHUNK;
        for (int jj = 0; jj < cn; jj++) {
            const int j = j0 + c + jj;
            if (j + ATT_PF < L) prefetch_row(md->k_cache, md->dtype, kb + (int64_t)cslot[j + ATT_PF] * row, hd);
            const int64_t off = kb + (int64_t)cslot[j] * row;
            prefetch_row(md->v_cache, md->dtype, off, hd); /* read after the scores */
            for (int v = 0; v < nv; v++) vf_store(kt + jj * hd + v * VL, load_kv(md->k_cache, md->dtype, off + v * VL));
        }
        if (cn < ATT_CHUNK) memset(kt + cn * hd, 0, (size_t)(ATT_CHUNK - cn) * hd * sizeof(float));
        switch (nv) {
        case 64 / VL: att_scores_t(md, q, kt, p, G, c, cn, 64 / VL); break;
        case 128 / VL: att_scores_t(md, q, kt, p, G, c, cn, 128 / VL); break;
        case 256 / VL: att_scores_t(md, q, kt, p, G, c, cn, 256 / VL); break;
        default: att_scores_t(md, q, kt, p, G, c, cn, nv); break;
        }
    }
    for (int g = 0; g < G; g++) softmax(p + g * md->max_ctx, n, stats ? stats + 2 * g : NULL);
    for (int d0 = 0; d0 < hd; d0 += ATT_DV * VL) {
        const int vn = (hd - d0) / VL < ATT_DV ? (hd - d0) / VL : ATT_DV;
        for (int g0 = 0; g0 < G; g0 += ATT_G) {
            const int gn = G - g0 < ATT_G ? G - g0 : ATT_G;
#define ATT_VALUES(GN) att_values_t(md, p, o, kb, cslot, j0, n, d0, g0, GN, ATT_DV)
            if (vn < ATT_DV) att_values_t(md, p, o, kb, cslot, j0, n, d0, g0, gn, vn);
            else if (gn == 1) ATT_VALUES(1);
            else if (gn == 2) ATT_VALUES(2);
            else if (gn == 3) ATT_VALUES(3);
            else ATT_VALUES(4);
#undef ATT_VALUES
        }
    }
}

/* Span sp of T of task s (keys j0..L-1; s < T): its unnormalized output and (max, sum) per query
 * head into split_att [G, hd] + [G, 2]; the span that finishes last merges the T into o [G, hd]. */
static void attend_span(const Model *md, const float *q, float *o, float *p, float *kt, int64_t base, const int32_t *cslot,
                        int kh, int j0, int L, int s, int sp, int T) {
    const int hd = md->head_dim, G = md->num_heads / md->num_kv_heads, stride = G * (hd + 2);
    const int a = j0 + (int)((int64_t)sp * (L - j0) / T), b = j0 + (int)((int64_t)(sp + 1) * (L - j0) / T);
    float *first = md->split_att + (int64_t)s * SPLIT_THREADS * stride, *part = first + (int64_t)sp * stride;
    attend(md, q, part, p + (a - j0), kt, base, cslot, kh, a, b, part + G * hd);
    if (!last_span(&md->split_count[s], T)) return;
    for (int g = 0; g < G; g++) {
        float mx = -INFINITY, den = 0.0f, w[SPLIT_THREADS];
        for (int i = 0; i < T; i++) mx = fmaxf(mx, first[i * stride + G * hd + 2 * g]); /* a span has keys: finite */
        for (int i = 0; i < T; i++) {
            const float *st = first + i * stride + G * hd + 2 * g;
            w[i] = st[1] > 0.0f ? expf(st[0] - mx) : 0.0f; /* an empty span: max -inf, sum 0 */
            den += w[i] * st[1];
        }
        for (int d = 0; d < hd; d += VL) {
            vf acc = vf_zero();
            for (int i = 0; i < T; i++) acc = vf_fma(vf_set1(w[i] / den), vf_load(first + i * stride + g * hd + d), acc);
            vf_store(o + g * hd + d, acc);
        }
    }
}

static void matmul(const Model *md, const Lin *L, const float *x, int ldx, float *out, int ldo, int M, int coded) {
    matmul_nobias(md, L, x, ldx, out, ldo, M, coded);
    if (L->bias) {
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int m = 0; m < M; m++)
            for (int n = 0; n < L->n; n++) out[(int64_t)m * ldo + n] += L->bias[n];
    }
}

/* out[M, N] = x[M, K] @ W^T on its own: the matmul kernels' test entry (tests/kernels_tests). */
void slotune_matmul(const Model *md, const Lin *L, const float *x, float *out, int M, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    matmul(md, L, x, L->k, out, L->n, M, 0);
}

/* Which kernels this build holds (ISA_* flags): cpu_decode.py repacks int8 weights by this, not by
 * its own reading of the CPU flags, so a repacked layout always has its kernel. */
/* Channels per block of torch's CPU int4 pack that the int4 kernels read: torch lays it out per its
 * own runtime ISA (64 for AVX-512, 32 for AVX2), which cpu_decode.py checks against this. */
int slotune_int4_block(void) { return INT4_BLOCK; }

/* Turn the AMX kernels on (asking Linux for tile state the first time) or off; returns whether they
 * are on. Off until asked: cpu_decode.py turns them on at load. */
int slotune_set_amx(int on) {
#ifdef HAVE_AMX
    amx_ok = on ? (amx_ok == 0 ? -1 : amx_ok) : 0;
    return on ? amx_request() : 0;
#else
    (void)on;
    return 0;
#endif
}

int slotune_isa(void) {
    return ISA_FLOAT
#ifdef HAVE_AMX
           | (amx_ok > 0 ? ISA_AMX : 0)
#endif
#ifdef HAVE_VNNI
           | ISA_INT8_VNNI | ISA_INT4_INT8ACT
#endif
#ifdef HAVE_INT8_AVX2
           | ISA_INT8_AVX2 | ISA_INT4_INT8ACT
#endif
        ;
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
        const int T = omp_get_num_threads();
#ifdef SLOTUNE_PROFILE
#pragma omp master
        prof_last = omp_get_wtime();
#endif
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int m = 0; m < M; m++) {
            const float es = md->embed_scale > 0.0f ? md->embed_scale : 1.0f;
            for (int i = 0; i < D; i++) md->x[(int64_t)m * D + i] = load_w(md->embed, md->dtype, ids[m] * D + i) * es;
            /* cache slot of every key of this row, once per step for all layers and heads: a
             * division per key and head in the attention loop was ~1/2 of its time at 64 rows */
            const int32_t *bt = block_tables + (int64_t)m * bt_width;
            int32_t *cs = md->ctx_slots + (int64_t)m * md->max_ctx;
            for (int j = 0, b = 0; j <= pos[m]; b++)
                for (int i = 0; i < bs && j <= pos[m]; i++, j++) cs[j] = bt[b] * bs + i;
        }
        PROF(P_EMBED);
        for (int l = 0; l < md->num_layers; l++) {
            const Layer *ly = &md->layers[l];
            add_rms_norm(md, ly->input_norm, md->x, md->res, md->h, M, l == 0, &ly->qkv);
            PROF(P_NORM);
            matmul(md, &ly->qkv, md->h, D, md->qkv, qkv_n, M, 1);
            PROF(P_QKV);
            /* (q/k norm,) rotary on q and k heads, then store k and v at the token's slot */
#pragma omp for schedule(SLOTUNE_SCHEDULE)
            for (int m = 0; m < M; m++) {
                float *r = md->qkv + (int64_t)m * qkv_n;
                const float *cs = ly->cos_sin ? ly->cos_sin + pos[m] * md->rot_dim : NULL;
                for (int h = 0; h < H + Hkv; h++) {
                    if (ly->q_norm) head_rms_norm(r + h * hd, h < H ? ly->q_norm : ly->k_norm, md->dtype, hd, md->eps);
                    if (cs) rotate(r + h * hd, cs, md->rot_dim / 2);
                }
                if (slots[m] >= 0) {
                    const int64_t off = l * layer_stride + slots[m] * Hkv * hd;
                    put_kv(md->k_cache, md->dtype, off, r + H * hd, Hkv * hd);
                    put_kv(md->v_cache, md->dtype, off, r + (H + Hkv) * hd, Hkv * hd);
                }
            }
            PROF(P_ROPE_KV);
            /* attention: one task per (sequence, kv head), its G query heads together; a sliding
             * window keeps the last `window` keys (the token itself included). Fewer tasks than threads
             * (one kv head at batch 1) leave threads idle: then each task is cut into T spans of keys,
             * merged by the span that finishes last (attend_span). */
            const int tasks = M * Hkv, spans = tasks < T && T <= SPLIT_THREADS ? T : 1;
#pragma omp for schedule(SLOTUNE_SCHEDULE)
            for (int t = 0; t < tasks * spans; t++) {
                const int task = t / spans, m = task / Hkv, kh = task % Hkv, L = (int)pos[m] + 1;
                const int j0 = ly->window > 0 && L > ly->window ? L - ly->window : 0;
                const float *q = md->qkv + (int64_t)m * qkv_n + kh * G * hd;
                float *o = md->att + (int64_t)m * H * hd + kh * G * hd, *p = md->probs + (int64_t)task * G * md->max_ctx;
                const int32_t *cs = md->ctx_slots + (int64_t)m * md->max_ctx;
                if (spans == 1) attend(md, q, o, p, kt, l * layer_stride, cs, kh, j0, L, NULL);
                else attend_span(md, q, o, p, kt, l * layer_stride, cs, kh, j0, L, task, t % spans, spans);
            }
            PROF(P_ATTN);
            matmul(md, &ly->o, md->att, H * hd, md->x, D, M, 0);
            PROF(P_O);
            if (ly->attn_out_norm) rms_norm_rows(md, ly->attn_out_norm, md->x, M);
            add_rms_norm(md, ly->post_norm, md->x, md->res, md->h, M, 0, &ly->gate_up);
            PROF(P_NORM);
            matmul(md, &ly->gate_up, md->h, D, md->gu, 2 * I, M, 1);
            PROF(P_GATE_UP);
            gate_mul(md, md->gu, md->act, M, I, md->gelu, &ly->down);
            PROF(P_GATE);
            matmul(md, &ly->down, md->act, I, md->x, D, M, 1);
            PROF(P_DOWN);
            if (ly->mlp_out_norm) rms_norm_rows(md, ly->mlp_out_norm, md->x, M);
        }
        add_rms_norm(md, md->final_norm, md->x, md->res, md->h, M, 0, NULL);
#pragma omp for schedule(SLOTUNE_SCHEDULE)
        for (int r = 0; r < num_logit_rows; r++) /* only the rows that sample pay for the LM head */
            memcpy(md->x + (int64_t)r * D, md->h + (int64_t)logit_rows[r] * D, (size_t)D * sizeof(float));
        PROF(P_NORM);
        matmul(md, &md->lm_head, md->x, D, logits, md->vocab, num_logit_rows, 0);
        PROF(P_LM_HEAD);
    }
}
