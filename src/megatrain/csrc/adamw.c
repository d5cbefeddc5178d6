/* One fused pass of AdamW over a flat fp32 block, writing the bf16 shadow in the same pass.
 *
 * Reads master p, states m and v, and the gradient g (fp32, or bf16 that may live in the same
 * memory as the shadow: each element is read before it is written); writes p, m, v and the
 * shadow. Same arithmetic, in the same order, as torch.optim.AdamW's single-tensor path:
 *   p *= decay; m = m + (1-b1) * (g - m); v = v*b2 + (1-b2)*g*g;
 *   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * The fp32 -> bf16 cast rounds to nearest even, as torch does.
 *
 * mt_adamw_bf16 and mt_adamw_int8 do the same update on compressed states (bf16, or 8-bit codes
 * with a per-block absmax; store/states.py describes the layouts): each dequantizes m and v as
 * it reads them, updates in fp32 registers, and writes them back rounded, still one pass over
 * memory. They take a whole store block at once (the decay factor applies below `decay_end`)
 * because a quantization block may straddle the decay boundary. Every operation is an IEEE
 * float op in the order of the torch reference (optim/adamw.py), built with -ffp-contract=off,
 * so the two agree bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_load(const uint16_t *x, int64_t i) {
    uint32_t u = ((uint32_t)x[i]) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Work is handed out in chunks of CHUNK elements, dynamically: the host also runs the Python
 * thread driving the GPU and CUDA's own threads, so a static split would make every thread
 * wait for whichever one shares its core. */
#define CHUNK ((int64_t)1 << 16)

#define ADAMW_LOOP(LOAD_G)                                                        \
    _Pragma("omp simd")                                                           \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float gi = (LOAD_G) * grad_scale;                                         \
        float pi = p[i] * decay;                                                  \
        float mi = m[i] + one_minus_b1 * (gi - m[i]);                             \
        float vi = v[i] * beta2 + one_minus_b2 * gi * gi;                         \
        float denom = sqrtf(vi) / bc2_sqrt + eps;                                 \
        pi = pi - step_size * (mi / denom);                                       \
        p[i] = pi;                                                                \
        m[i] = mi;                                                                \
        v[i] = vi;                                                                \
        SHADOW_STORE                                                              \
    }

void mt_adamw(float *p, float *m, float *v, const void *g, int g_is_bf16, uint16_t *shadow,
              int64_t n, float decay, float beta2, float one_minus_b1, float one_minus_b2,
              float step_size, float bc2_sqrt, float eps, float grad_scale, int nthreads) {
    const uint16_t *gb = (const uint16_t *)g;
    const float *gf = (const float *)g;
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t lo = c * CHUNK;
        const int64_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        if (shadow && g_is_bf16) {
#define SHADOW_STORE shadow[i] = bf16_round(pi);
            ADAMW_LOOP(bf16_load(gb, i))
        } else if (shadow) {
            ADAMW_LOOP(gf[i])
#undef SHADOW_STORE
        } else if (g_is_bf16) {
#define SHADOW_STORE
            ADAMW_LOOP(bf16_load(gb, i))
        } else {
            ADAMW_LOOP(gf[i])
#undef SHADOW_STORE
        }
    }
}

/* fp32 -> bf16 with round-to-nearest-even, parallel (torch's CPU cast is single-pass but slow). */
void mt_to_bf16(const float *src, uint16_t *dst, int64_t n, int nthreads) {
#pragma omp parallel for simd num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_round(src[i]);
}

/* A 32-bit integer hash (C. Wellons' lowbias32), the same as store/states.py's. */
static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* fp32 -> bf16 rounding up in magnitude with probability equal to the dropped fraction: adds
 * the top 16 of 32 random bits below the bf16 mantissa and truncates. */
static inline uint16_t bf16_round_stochastic(float f, uint32_t bits) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t magnitude = u & 0x7fffffffu;
    const uint32_t special = (u >> 16) | (magnitude > 0x7f800000u ? 0x40u : 0u); /* NaN, inf */
    return (uint16_t)(magnitude >= 0x7f800000u ? special : (u + (bits >> 16)) >> 16);
}

/* The AdamW arithmetic of ADAMW_LOOP on element i whose old m, v are mo, vo. */
#define ADAMW_ELEMENT(LOAD_G)                                                     \
    float gi = (LOAD_G) * grad_scale;                                             \
    float pi = i < decay_end ? p[i] * decay : p[i];                               \
    float mi = mo + one_minus_b1 * (gi - mo);                                     \
    float vi = vo * beta2 + one_minus_b2 * gi * gi;                               \
    float denom = sqrtf(vi) / bc2_sqrt + eps;                                     \
    pi = pi - step_size * (mi / denom);                                           \
    p[i] = pi;

/* Random bits of element i: lowbias32(low 32 bits of i ^ lowbias32(key ^ high 32 bits)); a
 * chunk never crosses a multiple of 2^32, so the inner hash is one per chunk. */
#define BF16_LOOP(LOAD_G, SHADOW)                                                 \
    _Pragma("omp simd")                                                           \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = bf16_load(m, i);                                               \
        float vo = bf16_load(v, i);                                               \
        ADAMW_ELEMENT(LOAD_G)                                                     \
        SHADOW                                                                    \
        m[i] = bf16_round_stochastic(mi, lowbias32((uint32_t)i ^ chunk_key_m));   \
        v[i] = bf16_round_stochastic(vi, lowbias32((uint32_t)i ^ chunk_key_v));   \
    }

void mt_adamw_bf16(float *p, uint16_t *m, uint16_t *v, const void *g, int g_is_bf16,
                   uint16_t *shadow, int64_t n, int64_t decay_end, float decay, float beta2,
                   float one_minus_b1, float one_minus_b2, float step_size, float bc2_sqrt,
                   float eps, float grad_scale, uint32_t key_m, uint32_t key_v, int nthreads) {
    const uint16_t *gb = (const uint16_t *)g;
    const float *gf = (const float *)g;
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t lo = c * CHUNK;
        const int64_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        const uint32_t chunk_key_m = lowbias32(key_m ^ (uint32_t)((uint64_t)lo >> 32));
        const uint32_t chunk_key_v = lowbias32(key_v ^ (uint32_t)((uint64_t)lo >> 32));
        if (shadow && g_is_bf16) {
            BF16_LOOP(bf16_load(gb, i), shadow[i] = bf16_round(pi);)
        } else if (shadow) {
            BF16_LOOP(gf[i], shadow[i] = bf16_round(pi);)
        } else if (g_is_bf16) {
            BF16_LOOP(bf16_load(gb, i), )
        } else {
            BF16_LOOP(gf[i], )
        }
    }
}

#define QBLOCK 2048 /* store/states.py QUANT_BLOCK; CHUNK is a multiple of it */

/* Index of the nearest map value = how many of the ascending midpoints lie below x, from one
 * 32-bit entry of `table`, indexed by the top 16 bits of x (store/states.py quantize_table):
 * bits 0-7 hold that count for the lowest float sharing them, bit 8 whether the next midpoint
 * shares them too (at most one can: the tables' builder checks it), bits 16-31 that midpoint's
 * low 16 bits. Floats sharing their top 16 bits order as their low bits do (reversed for
 * negatives: sign and magnitude), so "midpoint < x" is an integer comparison of low bits. Same
 * as torch.searchsorted; integer operations and one gather, so the loop vectorizes. */
static inline uint8_t quantize(const uint32_t *table, uint32_t u) {
    const uint32_t e = table[u >> 16], low = u & 0xffffu, mid = e >> 16;
    const uint32_t above = (u >> 31) ? (low < mid) : (low > mid);
    return (uint8_t)((e & 0xffu) + (((e >> 8) & 1u) & above));
}

static inline uint32_t float_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* First half of an int8 block: dequantize, update, keep the new m and v for requantizing. */
#define INT8_LOOP(LOAD_G, SHADOW)                                                 \
    _Pragma("omp simd reduction(max : max_m, max_v)")                             \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = map_m[m[i]] * scale_m;                                         \
        float vo = map_v[v[i]] * scale_v;                                         \
        ADAMW_ELEMENT(LOAD_G)                                                     \
        SHADOW                                                                    \
        new_m[i - lo] = mi;                                                       \
        new_v[i - lo] = vi;                                                       \
        float abs_m = fabsf(mi);                                                  \
        max_m = abs_m > max_m ? abs_m : max_m;                                    \
        max_v = vi > max_v ? vi : max_v;                                          \
    }

void mt_adamw_int8(float *p, uint8_t *m, float *m_absmax, uint8_t *v, float *v_absmax,
                   const void *g, int g_is_bf16, uint16_t *shadow, int64_t n, int64_t decay_end,
                   float decay, float beta2, float one_minus_b1, float one_minus_b2,
                   float step_size, float bc2_sqrt, float eps, float grad_scale,
                   const float *map_m, const uint32_t *table_m, const float *map_v,
                   const uint32_t *table_v,
                   int nthreads) {
    const uint16_t *gb = (const uint16_t *)g;
    const float *gf = (const float *)g;
    const int64_t nblocks = (n + QBLOCK - 1) / QBLOCK;
#pragma omp parallel for schedule(dynamic, CHUNK / QBLOCK) num_threads(nthreads)
    for (int64_t b = 0; b < nblocks; b++) {
        /* The block's new m and v wait here (in L1) until its new absmax is known. The absmax
         * ignores NaN (the comparison is false), where torch's amax would propagate it. */
        float new_m[QBLOCK], new_v[QBLOCK];
        const int64_t lo = b * QBLOCK;
        const int64_t hi = lo + QBLOCK < n ? lo + QBLOCK : n;
        const float scale_m = m_absmax[b], scale_v = v_absmax[b];
        float max_m = 0.0f, max_v = 0.0f;
        if (shadow && g_is_bf16) {
            INT8_LOOP(bf16_load(gb, i), shadow[i] = bf16_round(pi);)
        } else if (shadow) {
            INT8_LOOP(gf[i], shadow[i] = bf16_round(pi);)
        } else if (g_is_bf16) {
            INT8_LOOP(bf16_load(gb, i), )
        } else {
            INT8_LOOP(gf[i], )
        }
        m_absmax[b] = max_m;
        v_absmax[b] = max_v;
        const float div_m = max_m > 0.0f ? max_m : 1.0f;
        const float div_v = max_v > 0.0f ? max_v : 1.0f;
        uint8_t *mq = m + lo, *vq = v + lo;
        const int len = (int)(hi - lo);
#pragma omp simd
        for (int j = 0; j < len; j++) {
            mq[j] = quantize(table_m, float_bits(new_m[j] / div_m));
            vq[j] = quantize(table_v, float_bits(new_v[j] / div_v));
        }
    }
}

/* ---- bf16 master weights (optimizer.master_dtype: bf16; store/master.py) ----
 * The master p is bf16 and is itself the copy the device streams: there is no shadow, and the
 * gradient g has a buffer of its own. Each element of p is read into fp32, takes exactly
 * ADAMW_ELEMENT's arithmetic, and is rounded stochastically back into bf16 with the bits
 * lowbias32(i ^ chunk_key_p), the same bits formula as the bf16 states' (key_p: store/states.py
 * rounding_key(block, step, "p")). One pass; m and v are kept in fp32, bf16 or int8 as above.
 * optim/bf16_master.py's torch reference does the same operations; the two agree bit for bit. */
/* A bf16 master's gradient `g` (`g_kind`): fp32 (0), bf16 (1), or int8 codes read as
 * code * g_unit[i / QBLOCK], one fp32 unit per quantization block of the codes (2: a gradient held
 * compactly until its update, store/grads.py). Each kernel below expands its loop once per kind. */
#define G_BF16 1
#define G_INT8 2
#define GRAD_KINDS(LOOP)                                                          \
    if (g_kind == G_BF16) {                                                       \
        LOOP(bf16_load(gb, i))                                                    \
    } else if (g_kind == G_INT8) {                                                \
        LOOP((float)gq[i] * g_unit[i / QBLOCK])                                   \
    } else {                                                                      \
        LOOP(gf[i])                                                               \
    }
#define GRAD_POINTERS                                                             \
    const uint16_t *gb = (const uint16_t *)g;                                     \
    const float *gf = (const float *)g;                                           \
    const int8_t *gq = (const int8_t *)g;

#define MASTER_ELEMENT(LOAD_G)                                                    \
    float gi = (LOAD_G) * grad_scale;                                             \
    float po = bf16_load(p, i);                                                   \
    float pi = i < decay_end ? po * decay : po;                                   \
    float mi = mo + one_minus_b1 * (gi - mo);                                     \
    float vi = vo * beta2 + one_minus_b2 * gi * gi;                               \
    float denom = sqrtf(vi) / bc2_sqrt + eps;                                     \
    pi = pi - step_size * (mi / denom);                                           \
    p[i] = bf16_round_stochastic(pi, lowbias32((uint32_t)i ^ chunk_key_p));

#define MASTER_FP32_LOOP(LOAD_G)                                                  \
    _Pragma("omp simd")                                                           \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = m[i];                                                          \
        float vo = v[i];                                                          \
        MASTER_ELEMENT(LOAD_G)                                                    \
        m[i] = mi;                                                                \
        v[i] = vi;                                                                \
    }

/* bf16 master, fp32 m and v. */
void mt_adamw_bf16m_fp32(uint16_t *p, float *m, float *v, const void *g, int g_kind,
                         const float *g_unit, int64_t n, int64_t decay_end, float decay,
                         float beta2, float one_minus_b1, float one_minus_b2, float step_size,
                         float bc2_sqrt, float eps, float grad_scale, uint32_t key_p,
                         int nthreads) {
    GRAD_POINTERS
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t lo = c * CHUNK;
        const int64_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        const uint32_t chunk_key_p = lowbias32(key_p ^ (uint32_t)((uint64_t)lo >> 32));
        GRAD_KINDS(MASTER_FP32_LOOP)
    }
}

#define MASTER_BF16_LOOP(LOAD_G)                                                  \
    _Pragma("omp simd")                                                           \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = bf16_load(m, i);                                               \
        float vo = bf16_load(v, i);                                               \
        MASTER_ELEMENT(LOAD_G)                                                    \
        m[i] = bf16_round_stochastic(mi, lowbias32((uint32_t)i ^ chunk_key_m));   \
        v[i] = bf16_round_stochastic(vi, lowbias32((uint32_t)i ^ chunk_key_v));   \
    }

/* bf16 master, bf16 m and v (each with its own key, as mt_adamw_bf16). */
void mt_adamw_bf16m_bf16(uint16_t *p, uint16_t *m, uint16_t *v, const void *g, int g_kind,
                         const float *g_unit, int64_t n, int64_t decay_end, float decay,
                         float beta2, float one_minus_b1, float one_minus_b2, float step_size,
                         float bc2_sqrt, float eps, float grad_scale, uint32_t key_p,
                         uint32_t key_m, uint32_t key_v, int nthreads) {
    GRAD_POINTERS
    const int64_t nchunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t lo = c * CHUNK;
        const int64_t hi = lo + CHUNK < n ? lo + CHUNK : n;
        const uint32_t high = (uint32_t)((uint64_t)lo >> 32);
        const uint32_t chunk_key_p = lowbias32(key_p ^ high);
        const uint32_t chunk_key_m = lowbias32(key_m ^ high);
        const uint32_t chunk_key_v = lowbias32(key_v ^ high);
        GRAD_KINDS(MASTER_BF16_LOOP)
    }
}

#define MASTER_INT8_LOOP(LOAD_G)                                                  \
    _Pragma("omp simd reduction(max : max_m, max_v)")                             \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = map_m[m[i]] * scale_m;                                         \
        float vo = map_v[v[i]] * scale_v;                                         \
        MASTER_ELEMENT(LOAD_G)                                                    \
        new_m[i - lo] = mi;                                                       \
        new_v[i - lo] = vi;                                                       \
        float abs_m = fabsf(mi);                                                  \
        max_m = abs_m > max_m ? abs_m : max_m;                                    \
        max_v = vi > max_v ? vi : max_v;                                          \
    }

/* bf16 master, int8 m and v: mt_adamw_int8's two halves per quantization block. */
void mt_adamw_bf16m_int8(uint16_t *p, uint8_t *m, float *m_absmax, uint8_t *v, float *v_absmax,
                         const void *g, int g_kind, const float *g_unit, int64_t n,
                         int64_t decay_end, float decay, float beta2, float one_minus_b1,
                         float one_minus_b2, float step_size, float bc2_sqrt, float eps,
                         float grad_scale,
                         const float *map_m, const uint32_t *table_m, const float *map_v,
                         const uint32_t *table_v, uint32_t key_p, int nthreads) {
    GRAD_POINTERS
    const int64_t nblocks = (n + QBLOCK - 1) / QBLOCK;
#pragma omp parallel for schedule(dynamic, CHUNK / QBLOCK) num_threads(nthreads)
    for (int64_t b = 0; b < nblocks; b++) {
        float new_m[QBLOCK], new_v[QBLOCK];
        const int64_t lo = b * QBLOCK;
        const int64_t hi = lo + QBLOCK < n ? lo + QBLOCK : n;
        const uint32_t chunk_key_p = lowbias32(key_p ^ (uint32_t)((uint64_t)lo >> 32));
        const float scale_m = m_absmax[b], scale_v = v_absmax[b];
        float max_m = 0.0f, max_v = 0.0f;
        GRAD_KINDS(MASTER_INT8_LOOP)
        m_absmax[b] = max_m;
        v_absmax[b] = max_v;
        const float div_m = max_m > 0.0f ? max_m : 1.0f;
        const float div_v = max_v > 0.0f ? max_v : 1.0f;
        uint8_t *mq = m + lo, *vq = v + lo;
        const int len = (int)(hi - lo);
#pragma omp simd
        for (int j = 0; j < len; j++) {
            mq[j] = quantize(table_m, float_bits(new_m[j] / div_m));
            vq[j] = quantize(table_v, float_bits(new_v[j] / div_v));
        }
    }
}

/* ---------------------------------------------------------------- 4-bit states (int4) */

#define Q4BLOCK 128 /* store/int4.py INT4_BLOCK; CHUNK is a multiple of it */
#define Q4HALF 64   /* bytes of codes per quantization block and state */

/* Codes of x: how many of the 15 ascending midpoints of the map lie below x, as
 * torch.searchsorted (NaN sorts above all of them: 15). A few integer or float operations, no
 * gather: the requantizing loop vectorizes.
 *
 * m (store/int4.py, signed map): its midpoints are 7 negative ones, the negations of the 7
 * lowest of the 8 positive ones `pos_bits` (their float32 patterns; the map's builder checks the
 * symmetry). For x >= 0 the code is 7 + the positive ones below x; for x < 0 it is the negative
 * ones below x, 7 - the positive ones <= |x|, i.e. below the next float above |x| (pattern + 1),
 * at least 0. Non-negative floats order as their patterns do, so all compares are integer. */
static inline uint32_t quantize4_m(const uint32_t *pos_bits, float x) {
    const uint32_t u = float_bits(x), magnitude = u & 0x7fffffffu, negative = u >> 31;
    const uint32_t key = magnitude + negative;
    int32_t below = 0;
    for (int k = 0; k < 8; k++) below += pos_bits[k] < key;
    const int32_t code = negative ? (7 - below > 0 ? 7 - below : 0) : 7 + below;
    return magnitude > 0x7f800000u ? 15u : (uint32_t)code;
}

static inline float float_of_bits(uint32_t u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* v (store/int4.py, the linear map (k + 1) / 16): its midpoints are (k + 1.5) / 16, k = 0..14,
 * so the code is the number of integers k in 0..14 below t = 16 y - 1.5, i.e. ceil(t) at least
 * 0, with y = x clamped to [0, 1] (a negative x counts as 0, NaN of either sign and x > 1 as 1:
 * torch.searchsorted's codes). 16 y is exact, and so is 16 y - 1.5 wherever it is >= 0; where it
 * is not, the code is 0 either way. The clamp is on the pattern and the ceiling a truncation
 * plus (t > it), so that no float operation is conditional: GCC then vectorizes the loop
 * (ceilf, or a select after a float operation, keeps it scalar under -ftrapping-math). */
static inline uint32_t quantize4_v(float x) {
    const uint32_t u = float_bits(x), magnitude = u & 0x7fffffffu;
    int32_t s = (int32_t)(magnitude > 0x7f800000u ? magnitude : u); /* NaN: positive */
    s = s < 0 ? 0 : s;
    s = s > 0x3f800000 ? 0x3f800000 : s; /* 1.0f */
    const float t = float_of_bits((uint32_t)s) * 16.0f - 1.5f;
    int32_t c = (int32_t)t;
    c += t > (float)c;
    return (uint32_t)(c > 0 ? c : 0);
}

/* One half of an int4 block: values lo .. hi-1 whose codes are the nibbles at `shift` of
 * bytes mq[0..], vq[0..]; dequantize, update, keep the new m and v for requantizing. v's map
 * value (k + 1) / 16 is computed, not read: the same float, one gather fewer (1.14x). */
#define INT4_LOOP(LOAD_G, SHADOW)                                                 \
    _Pragma("omp simd reduction(max : max_m, max_v)")                             \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = map_m[(mq[i - lo] >> shift) & 15u] * scale_m;                  \
        float vo = (float)(((vq[i - lo] >> shift) & 15u) + 1u) * 0.0625f * scale_v; \
        ADAMW_ELEMENT(LOAD_G)                                                     \
        SHADOW                                                                    \
        new_m[i - lo + half] = mi;                                                \
        new_v[i - lo + half] = vi;                                                \
        float abs_m = fabsf(mi);                                                  \
        max_m = abs_m > max_m ? abs_m : max_m;                                    \
        max_v = vi > max_v ? vi : max_v;                                          \
    }

/* Past the end of a partial block the new m and v are 0 (codes of 0 and of v's smallest value,
 * as the reference): from `used` to the half's end. */
static inline void int4_zero_tail(float *new_m, float *new_v, int64_t used) {
    for (int64_t j = used; j < Q4HALF; j++) {
        new_m[j] = 0.0f;
        new_v[j] = 0.0f;
    }
}

/* A block's new absmax and its 128 m and v requantized into two nibbles a byte; two loops:
 * GCC does not if-convert the two quantizers in one. */
static inline void int4_requantize(uint8_t *mq, uint8_t *vq, const float *new_m,
                                   const float *new_v, float max_m, float max_v, float *absmax_m,
                                   float *absmax_v, const uint32_t *pos_bits_m) {
    *absmax_m = max_m;
    *absmax_v = max_v;
    const float div_m = max_m > 0.0f ? max_m : 1.0f;
    const float div_v = max_v > 0.0f ? max_v : 1.0f;
#pragma omp simd
    for (int j = 0; j < Q4HALF; j++) {
        const uint32_t lo_code = quantize4_m(pos_bits_m, new_m[j] / div_m);
        const uint32_t hi_code = quantize4_m(pos_bits_m, new_m[j + Q4HALF] / div_m);
        mq[j] = (uint8_t)(lo_code | hi_code << 4);
    }
#pragma omp simd
    for (int j = 0; j < Q4HALF; j++) {
        const uint32_t lo_code = quantize4_v(new_v[j] / div_v);
        const uint32_t hi_code = quantize4_v(new_v[j + Q4HALF] / div_v);
        vq[j] = (uint8_t)(lo_code | hi_code << 4);
    }
}

void mt_adamw_int4(float *p, uint8_t *m, float *m_absmax, uint8_t *v, float *v_absmax,
                   const void *g, int g_is_bf16, uint16_t *shadow, int64_t n, int64_t decay_end,
                   float decay, float beta2, float one_minus_b1, float one_minus_b2,
                   float step_size, float bc2_sqrt, float eps, float grad_scale,
                   const float *map_m, const uint32_t *pos_bits_m, int nthreads) {
    const uint16_t *gb = (const uint16_t *)g;
    const float *gf = (const float *)g;
    const int64_t nblocks = (n + Q4BLOCK - 1) / Q4BLOCK;
#pragma omp parallel for schedule(dynamic, CHUNK / Q4BLOCK) num_threads(nthreads)
    for (int64_t b = 0; b < nblocks; b++) {
        /* The block's new m and v wait here until its new absmax is known; past the end of a
         * partial block they are 0 (codes of 0 and of v's smallest value, as the reference). */
        float new_m[Q4BLOCK], new_v[Q4BLOCK];
        uint8_t *mq = m + b * Q4HALF, *vq = v + b * Q4HALF;
        const float scale_m = m_absmax[b], scale_v = v_absmax[b];
        float max_m = 0.0f, max_v = 0.0f;
        for (int half = 0; half < Q4BLOCK; half += Q4HALF) {
            const int64_t lo = b * Q4BLOCK + half;
            const int64_t hi = lo + Q4HALF < n ? lo + Q4HALF : n;
            const int shift = half ? 4 : 0;
            int4_zero_tail(new_m + half, new_v + half, hi > lo ? hi - lo : 0);
            if (shadow && g_is_bf16) {
                INT4_LOOP(bf16_load(gb, i), shadow[i] = bf16_round(pi);)
            } else if (shadow) {
                INT4_LOOP(gf[i], shadow[i] = bf16_round(pi);)
            } else if (g_is_bf16) {
                INT4_LOOP(bf16_load(gb, i), )
            } else {
                INT4_LOOP(gf[i], )
            }
        }
        int4_requantize(mq, vq, new_m, new_v, max_m, max_v, &m_absmax[b], &v_absmax[b],
                        pos_bits_m);
    }
}

/* ---- bf16 master weights with int4 m and v: mt_adamw_int4's blocks, MASTER_ELEMENT's update
 * (the master read from bf16 and rounded stochastically back, no shadow). */
#define MASTER_INT4_LOOP(LOAD_G)                                                  \
    _Pragma("omp simd reduction(max : max_m, max_v)")                             \
    for (int64_t i = lo; i < hi; i++) {                                           \
        float mo = map_m[(mq[i - lo] >> shift) & 15u] * scale_m;                  \
        float vo = (float)(((vq[i - lo] >> shift) & 15u) + 1u) * 0.0625f * scale_v; \
        MASTER_ELEMENT(LOAD_G)                                                    \
        new_m[i - lo + half] = mi;                                                \
        new_v[i - lo + half] = vi;                                                \
        float abs_m = fabsf(mi);                                                  \
        max_m = abs_m > max_m ? abs_m : max_m;                                    \
        max_v = vi > max_v ? vi : max_v;                                          \
    }

void mt_adamw_bf16m_int4(uint16_t *p, uint8_t *m, float *m_absmax, uint8_t *v, float *v_absmax,
                         const void *g, int g_kind, const float *g_unit, int64_t n,
                         int64_t decay_end, float decay, float beta2, float one_minus_b1,
                         float one_minus_b2, float step_size, float bc2_sqrt, float eps,
                         float grad_scale,
                         const float *map_m, const uint32_t *pos_bits_m, uint32_t key_p,
                         int nthreads) {
    GRAD_POINTERS
    const int64_t nblocks = (n + Q4BLOCK - 1) / Q4BLOCK;
#pragma omp parallel for schedule(dynamic, CHUNK / Q4BLOCK) num_threads(nthreads)
    for (int64_t b = 0; b < nblocks; b++) {
        float new_m[Q4BLOCK], new_v[Q4BLOCK];
        uint8_t *mq = m + b * Q4HALF, *vq = v + b * Q4HALF;
        const float scale_m = m_absmax[b], scale_v = v_absmax[b];
        const uint32_t chunk_key_p = lowbias32(key_p ^ (uint32_t)((uint64_t)(b * Q4BLOCK) >> 32));
        float max_m = 0.0f, max_v = 0.0f;
        for (int half = 0; half < Q4BLOCK; half += Q4HALF) {
            const int64_t lo = b * Q4BLOCK + half;
            const int64_t hi = lo + Q4HALF < n ? lo + Q4HALF : n;
            const int shift = half ? 4 : 0;
            int4_zero_tail(new_m + half, new_v + half, hi > lo ? hi - lo : 0);
            GRAD_KINDS(MASTER_INT4_LOOP)
        }
        int4_requantize(mq, vq, new_m, new_v, max_m, max_v, &m_absmax[b], &v_absmax[b],
                        pos_bits_m);
    }
}
