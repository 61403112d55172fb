/* imggen's CPU training kernels, elementwise: torch's GELU (approximate="tanh") forward and
 * backward over contiguous float32 or bfloat16 arrays, OpenMP on torch's own thread pool (the same
 * runtime, so torch.set_num_threads applies). Built by imggen.cbuild, called from imggen/cpu_ops.py
 * through ctypes; torch.nn.functional.gelu and aten's gelu_backward are their reference
 * (tests/test_cpu_ops.py). bfloat16 is read and written as torch does (to float32 by a 16-bit shift;
 * back with round-to-nearest-even), the arithmetic is float32. */
#include "vmath.h"
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline v16 load_bf16(const uint16_t *p) {
#ifdef __AVX512F__
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    return (v16)_mm512_castsi512_ps(w);
#else
    vi16 w;
    for (int i = 0; i < 16; i++) w[i] = (int32_t)((uint32_t)p[i] << 16);
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
#endif
}

static inline void store_bf16(uint16_t *p, v16 f) {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)f));
#else
    uint32_t w[16];
    memcpy(w, &f, sizeof w);
    for (int i = 0; i < 16; i++) {
        uint32_t u = w[i];
        p[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u  /* NaN stays NaN */
                                                           : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
#endif
}

/* d gelu(x) / dx * dy, with gelu(x) = x s, s = (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u)),
 * u = sqrt(2/pi) (x + 0.044715 x^3): s + x s (1 - s) 2u' */
static inline v16 vgelu_grad(v16 x, v16 dy) {
    v16 x2 = x * x;
    v16 s = 1.0f / (1.0f + vexp(-1.5957691216057308f * (x + 0.044715f * x2 * x)));
    return dy * (s + x * s * (1.0f - s) * (1.5957691216057308f + 0.2140644f * x2));
}

/* One vector of 16 elements each: x, dy (backward only) -> out. */
static inline void gelu_f32(const void *x, const void *dy, void *out) {
    (void)dy;
    store16(out, vgelu(load16(x)));
}
static inline void gelu_backward_f32(const void *x, const void *dy, void *out) {
    store16(out, vgelu_grad(load16(x), load16(dy)));
}
static inline void gelu_bf16(const void *x, const void *dy, void *out) {
    (void)dy;
    store_bf16(out, vgelu(load_bf16(x)));
}
static inline void gelu_backward_bf16(const void *x, const void *dy, void *out) {
    store_bf16(out, vgelu_grad(load_bf16(x), load_bf16(dy)));
}

/* op over n elements of `size` bytes, 16 at a time; the last n % 16 through zero-padded copies */
static inline void each16(void (*op)(const void *, const void *, void *), const char *x, const char *dy, char *out,
                          int64_t n, int64_t size) {
    int64_t body = n - n % 16;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < body; i += 16) op(x + i * size, dy ? dy + i * size : NULL, out + i * size);
    if (body < n) {
        char tx[64] = {0}, tdy[64] = {0}, tout[64];
        memcpy(tx, x + body * size, (n - body) * size);
        if (dy) memcpy(tdy, dy + body * size, (n - body) * size);
        op(tx, tdy, tout);
        memcpy(out + body * size, tout, (n - body) * size);
    }
}

void imggen_gelu_f32(const float *x, float *out, int64_t n) {
    each16(gelu_f32, (const char *)x, NULL, (char *)out, n, 4);
}
void imggen_gelu_backward_f32(const float *dy, const float *x, float *out, int64_t n) {
    each16(gelu_backward_f32, (const char *)x, (const char *)dy, (char *)out, n, 4);
}
/* bfloat16 by table. A bfloat16 input takes one of 65,536 values, so the forward is one lookup of
 * the vector kernel's own result for it, and the backward one float32 lookup of d gelu / dx times dy:
 * the vector backward's last operation is that product, so both are bit-identical to computing each
 * element (tests/test_cpu_ops.py checks every input). Tables: 128 KB + 256 KB, filled once by
 * imggen_gelu_init (from cpu_ops.py, before any call). */
static uint16_t gelu_table[65536];
static float gelu_grad_table[65536];

void imggen_gelu_init(void) {
    for (int32_t i = 0; i < 65536; i += 16) {
        uint16_t x[16];
        for (int j = 0; j < 16; j++) x[j] = (uint16_t)(i + j);
        gelu_bf16(x, NULL, gelu_table + i);
        store16(gelu_grad_table + i, vgelu_grad(load_bf16(x), splat(1.0f)));
    }
}

/* the vector kernels the tables hold, element by element (tests compare the two) */
void imggen_gelu_bf16_direct(const uint16_t *x, uint16_t *out, int64_t n) {
    each16(gelu_bf16, (const char *)x, NULL, (char *)out, n, 2);
}
void imggen_gelu_backward_bf16_direct(const uint16_t *dy, const uint16_t *x, uint16_t *out, int64_t n) {
    each16(gelu_backward_bf16, (const char *)x, (const char *)dy, (char *)out, n, 2);
}

void imggen_gelu_bf16(const uint16_t *x, uint16_t *out, int64_t n) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = gelu_table[x[i]];
}

void imggen_gelu_backward_bf16(const uint16_t *dy, const uint16_t *x, uint16_t *out, int64_t n) {
    int64_t body = n - n % 16;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < body; i += 16) {
        float g[16];
        for (int j = 0; j < 16; j++) g[j] = gelu_grad_table[x[i + j]];
        store_bf16(out + i, load_bf16(dy + i) * load16(g));
    }
    if (body < n) {
        uint16_t tdy[16] = {0}, tx[16] = {0}, tout[16];
        memcpy(tdy, dy + body, (n - body) * 2);
        memcpy(tx, x + body, (n - body) * 2);
        imggen_gelu_backward_bf16(tdy, tx, tout, 16);
        memcpy(out + body, tout, (n - body) * 2);
    }
}
