/* One fused pass of AdamW over a flat fp32 block, writing the bf16 shadow in the same pass.
 *
 * Reads master p, states m and v, and the gradient g (fp32, or bf16 that may live in the same
 * memory as the shadow: each element is read before it is written); writes p, m, v and the
 * shadow. Same arithmetic, in the same order, as torch.optim.AdamW's single-tensor path:
 *   p *= decay; m = m + (1-b1) * (g - m); v = v*b2 + (1-b2)*g*g;
 *   p -= step_size * m / (sqrt(v) / bc2_sqrt + eps)
 * The fp32 -> bf16 cast rounds to nearest even, as torch does.
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
