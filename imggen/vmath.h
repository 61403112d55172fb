/* imggen's vector math for its C kernels (imggen/decode/native.c, imggen/cpu_ops.c): 16-float GCC
 * vectors, their loads and stores (float32 and bfloat16), exp and the tanh GELU. Built with
 * -O3 -march=native by imggen.cbuild, which hashes this header with each source that includes it. */
#ifndef IMGGEN_VMATH_H
#define IMGGEN_VMATH_H
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

static inline v16 load16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v16 splat(float x) { return (v16){0} + x; }

/* lanes of a where m is set (all ones), else of b: a select the compiler keeps in vector registers */
static inline v16 sel(vi16 m, v16 a, v16 b) {
    vi16 ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    ai = (ai & m) | (bi & ~m);
    memcpy(&a, &ai, sizeof a);
    return a;
}

/* exp of 16 floats: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (relative
 * error about 2e-7, the size of float32 rounding); x below -87.3 gives 0, above 88.7 gives inf */
static inline v16 vexp(v16 x) {
    const v16 big = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 lo = splat(-87.3f), hi = splat(88.7f);
    vi16 under = x < lo, over = x > hi;
    v16 xc = sel(under, lo, sel(over, hi, x));
    v16 n = (xc * 1.44269504088896341f + big) - big;
    v16 r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = splat(1.0f / 720) ;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
    v16 scale;
    memcpy(&scale, &e, sizeof scale);
    return sel(under, splat(0.0f), sel(over, splat(INFINITY), p * scale));
}

/* torch's GELU, approximate="tanh": 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with
 * tanh(u) = 1 - 2 / (exp(2u) + 1) */
static inline v16 vgelu(v16 x) {
    v16 u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    v16 t = 1.0f - 2.0f / (vexp(2.0f * u) + 1.0f);
    return 0.5f * x * (1.0f + t);
}

#endif
