/* imggen's CPU decode kernels (float32), built on first use by imggen/decode/native.py with the
 * machine's C compiler (-O3 -march=native -fopenmp) and called through ctypes. Their OpenMP
 * regions run on the runtime torch has already loaded (same soname), so torch.set_num_threads
 * applies. The PyTorch code they replace is their reference (imggen.decode.panels.reference_linear,
 * imggen.decode.decode_attention_reference); tests/test_native.py compares them.
 *
 * imggen_linear: y (M, N) = [add +] act(LN(x) @ W^T + bias), W^T held as panels
 *   (ceil(N/16), K, 16) (imggen.decode.panels): 16 rows of x against one panel keep 16 accumulators of 16
 *   columns in registers and read the panel once, front to back.
 * imggen_attend: one query per (batch, head) against cache slots (all of [0, nread), or gathered by
 *   an index per head), additive bias, softmax, weighted sum of values; optionally storing the new
 *   position's key and value in its slot first.
 * imggen_step: one decode step of a whole imggen.model.ImageTransformer (embedding, every Block
 *   through the two above with each cache's read plan, final LayerNorm and head), so that a step
 *   costs one call from Python.
 */
#include "vmath.h"

#define P 16    /* panel width = imggen.decode.panels.PANEL */
#define R 16    /* rows of x per register block */
#define MAXD 256 /* head dims up to this keep the output row in registers */
#ifndef PF
#define PF 256  /* weight prefetch distance in panel rows (64-byte lines): 16 KB ahead */
#endif

static inline float hsum(v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* rows [0, m) (m <= R) of xt (K, R: x transposed) against one panel (K, P) -> y rows (ldy apart) */
static void block(const float *xt, int m, int K, const float *w, const float *b, int act, const float *add,
                  float *y, int64_t ldy, int ncols) {
    v16 acc[R];
    v16 init = b ? load16(b) : splat(0.0f);
    for (int r = 0; r < R; r++) acc[r] = init;
    for (int k = 0; k < K; k++) {
        __builtin_prefetch(w + (int64_t)(k + PF) * P);
        v16 wk = load16(w + (int64_t)k * P);
        const float *xk = xt + (int64_t)k * R;
#pragma GCC unroll 16
        for (int r = 0; r < R; r++) acc[r] += xk[r] * wk;
    }
    for (int r = 0; r < m; r++) {
        v16 a = act ? vgelu(acc[r]) : acc[r];
        if (ncols == P) {
            if (add) a += load16(add + r * ldy);
            store16(y + r * ldy, a);
        } else {
            for (int j = 0; j < ncols; j++) y[r * ldy + j] = a[j] + (add ? add[r * ldy + j] : 0.0f);
        }
    }
}

/* mean and 1 / sqrt(variance + eps) of a row of K floats, as torch's LayerNorm */
static void row_stats(const float *row, int K, float eps, float *mean, float *rstd) {
    if (K % 16 == 0) {  /* two passes, 16 lanes of float sums (torch sums in float too) */
        v16 acc = splat(0.0f);
        for (int k = 0; k < K; k += 16) acc += load16(row + k);
        *mean = hsum(acc) / K;
        acc = splat(0.0f);
        for (int k = 0; k < K; k += 16) {
            v16 c = load16(row + k) - *mean;
            acc += c * c;
        }
        *rstd = 1.0f / sqrtf(hsum(acc) / K + eps);
    } else {
        double s = 0.0, ss = 0.0;
        for (int k = 0; k < K; k++) s += row[k];
        *mean = (float)(s / K);
        for (int k = 0; k < K; k++) ss += (double)(row[k] - *mean) * (row[k] - *mean);
        *rstd = (float)(1.0 / sqrt(ss / K + eps));
    }
}

/* x (M, K), rows ldx apart; ln_w / ln_b: NULL, or the LayerNorm (over K, eps) applied to x first;
 * panels (ceil(N/16), K, 16); bias NULL or (ceil(N/16) * 16,) zero-padded; act 1 = GELU (tanh);
 * add NULL or (M, N) added last; y (M, N). Returns 0, or -1 if out of memory. */
int imggen_linear(const float *x, int64_t M, int K, int64_t ldx, const float *ln_w, const float *ln_b, float eps,
                  const float *panels, const float *bias, int N, int act, const float *add, float *y) {
    int np = (N + P - 1) / P;
    int64_t nb = (M + R - 1) / R;
    float *xt = aligned_alloc(64, (sizeof(float) * K * R * nb + 63) / 64 * 64);
    if (!xt) return -1;
#pragma omp parallel
    {
        /* x (normalised) transposed into blocks of R rows: each thread a range of k (whole 16-float
         * tiles, so that no two threads write one cache line), each row's statistics its own copy */
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int k0 = (int)((int64_t)K * id / nt) & ~15, k1 = id == nt - 1 ? K : (int)((int64_t)K * (id + 1) / nt) & ~15;
        for (int64_t c = 0; c < nb; c++) {
            float *dst = xt + c * K * R;
            int m = M - c * R < R ? (int)(M - c * R) : R;
            for (int r = 0; r < m; r++) {
                const float *row = x + (c * R + r) * ldx;
                if (ln_w) {
                    float mean, rstd;
                    row_stats(row, K, eps, &mean, &rstd);
                    for (int k = k0; k < k1; k++) dst[k * R + r] = (row[k] - mean) * rstd * ln_w[k] + ln_b[k];
                } else {
                    for (int k = k0; k < k1; k++) dst[k * R + r] = row[k];
                }
            }
            for (int k = k0; k < k1; k++) for (int r = m; r < R; r++) dst[k * R + r] = 0.0f;
        }
#pragma omp barrier
#pragma omp for collapse(2) schedule(static)
        for (int p = 0; p < np; p++)
            for (int64_t c = 0; c < nb; c++) {
                int m = M - c * R < R ? (int)(M - c * R) : R;
                int ncols = N - p * P < P ? N - p * P : P;
                block(xt + c * K * R, m, K, panels + (int64_t)p * K * P, bias ? bias + p * P : NULL, act,
                      add ? add + c * R * N + p * P : NULL, y + c * R * N + p * P, N, ncols);
            }
    }
    free(xt);
    return 0;
}

/* 16 vectors -> one: lane i = the sum of the lanes of a[i] (a pairwise tree of shuffles) */
static inline v16 reduce16(v16 *a) {
    v16 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++)
        b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
             + __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
             + __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
         + __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline void prefetch_row(const float *p, int D) {
    for (int d = 0; d < D; d += 16) __builtin_prefetch(p + d);
}

/* s[j] = q . k[slot j] * scale + bias[j] for j < nread (slot j = ix[j], or j without ix), -inf
 * where the bias is -inf; prefetches the value rows the weighted sum reads next. Returns the max. */
static float scores(const float *qv, const float *kb, const float *vb, const int64_t *ix, const float *bs,
                    int64_t nread, int D, float scale, float *s) {
    const int vec = D % 16 == 0 && D <= MAXD;
    float mx = -INFINITY;
    int64_t j = 0;
    if (vec) {
        v16 qr[MAXD / 16];
        int nv = D / 16;
        for (int c = 0; c < nv; c++) qr[c] = load16(qv + 16 * c) * scale;
        for (; j + 16 <= nread; j += 16) {
            v16 acc[16];
            for (int r = 0; r < 16; r++) {
                int64_t slot = ix ? ix[j + r] : j + r;
                if (j + r + 16 < nread) prefetch_row(kb + (ix ? ix[j + r + 16] : j + r + 16) * D, D);
                prefetch_row(vb + slot * D, D);
                const float *kj = kb + slot * D;
                acc[r] = qr[0] * load16(kj);
                for (int c = 1; c < nv; c++) acc[r] += qr[c] * load16(kj + 16 * c);
            }
            v16 sc = reduce16(acc);
            if (bs) {
                v16 bj = load16(bs + j);
                sc += bj;
                vi16 masked = bj == -INFINITY;
                v16 ninf = splat(-INFINITY);
                vi16 si, ni;
                memcpy(&si, &sc, sizeof si);
                memcpy(&ni, &ninf, sizeof ni);
                si = (si & ~masked) | (ni & masked);
                memcpy(&sc, &si, sizeof sc);
            }
            store16(s + j, sc);
            for (int r = 0; r < 16; r++) mx = sc[r] > mx ? sc[r] : mx;
        }
    }
    for (; j < nread; j++) {
        float sj = -INFINITY;
        if (!bs || bs[j] != -INFINITY) {
            const float *kj = kb + (ix ? ix[j] : j) * D;
            if (vec) {
                v16 acc = load16(qv) * load16(kj);
                for (int d = 16; d < D; d += 16) acc += load16(qv + d) * load16(kj + d);
                sj = hsum(acc);
            } else {
                sj = 0.0f;
                for (int d = 0; d < D; d++) sj += qv[d] * kj[d];
            }
            sj = sj * scale + (bs ? bs[j] : 0.0f);
        }
        s[j] = sj;
        if (sj > mx) mx = sj;
    }
    return mx;
}

/* q, knew, vnew: (B, H, D) with batch rows ld apart (e.g. views into one qkv buffer); knew / vnew
 * NULL, or stored into slot `slot` of the caches first; k, v caches (B, H, L, D) contiguous;
 * index NULL (slots [0, nread)) or (index_heads, nread) int64 (index_heads 1 = shared by every
 * head, else H); bias NULL or (bias_heads, nread) additive (0 or -inf); out (B, H, D). A row with
 * nothing to read gives 0. Returns 0, or -1 if out of memory. */
int imggen_attend(const float *q, const float *knew, const float *vnew, int64_t ld, int64_t slot,
                  float *k, float *v, int B, int H, int64_t L, int D, const int64_t *index, int index_heads,
                  int64_t nread, const float *bias, int bias_heads, float *out) {
    const float scale = 1.0f / sqrtf((float)D);
    const int vec = D % 16 == 0 && D <= MAXD;
    int failed = 0;
#pragma omp parallel
    {
        float *s = malloc(sizeof(float) * (nread + 16));
        float *o = malloc(sizeof(float) * D);
        if (!s || !o) failed = 1;
#pragma omp for schedule(static)
        for (int bh = 0; bh < B * H; bh++) {
            if (!s || !o) continue;
            int b = bh / H, h = bh % H;
            const float *qv = q + b * ld + (int64_t)h * D;
            float *kb = k + (int64_t)bh * L * D, *vb = v + (int64_t)bh * L * D;
            if (knew) {
                memcpy(kb + slot * D, knew + b * ld + (int64_t)h * D, sizeof(float) * D);
                memcpy(vb + slot * D, vnew + b * ld + (int64_t)h * D, sizeof(float) * D);
            }
            const int64_t *ix = index ? index + (index_heads == 1 ? 0 : (int64_t)h * nread) : NULL;
            const float *bs = bias ? bias + (bias_heads == 1 ? 0 : (int64_t)h * nread) : NULL;
            float mx = scores(qv, kb, vb, ix, bs, nread, D, scale, s);
            float *od = out + (int64_t)bh * D;
            if (mx == -INFINITY) {  /* nothing to read */
                memset(od, 0, sizeof(float) * D);
                continue;
            }
            /* probabilities (unnormalised) */
            float total = 0.0f;
            int64_t j = 0;
            for (; j + 16 <= nread; j += 16) {
                v16 p = vexp(load16(s + j) - mx);
                store16(s + j, p);
                total += hsum(p);
            }
            if (j < nread) {
                v16 t = splat(-INFINITY);
                for (int64_t i = j; i < nread; i++) t[i - j] = s[i];
                v16 p = vexp(t - mx);
                for (int64_t i = j; i < nread; i++) { s[i] = p[i - j]; total += p[i - j]; }
            }
            float inv = 1.0f / total;
            /* weighted sum of values */
            if (vec) {
                v16 acc[MAXD / 16];
                int nv = D / 16;
                for (int c = 0; c < nv; c++) acc[c] = splat(0.0f);
                for (int64_t i = 0; i < nread; i++) {
                    if (s[i] == 0.0f) continue;
                    const float *vj = vb + (ix ? ix[i] : i) * D;
                    for (int c = 0; c < nv; c++) acc[c] += s[i] * load16(vj + 16 * c);
                }
                for (int c = 0; c < nv; c++) store16(od + 16 * c, acc[c] * inv);
            } else {
                for (int d = 0; d < D; d++) o[d] = 0.0f;
                for (int64_t i = 0; i < nread; i++) {
                    if (s[i] == 0.0f) continue;
                    const float *vj = vb + (ix ? ix[i] : i) * D;
                    for (int d = 0; d < D; d++) o[d] += s[i] * vj[d];
                }
                for (int d = 0; d < D; d++) od[d] = o[d] * inv;
            }
        }
        free(s);
        free(o);
    }
    return failed ? -1 : 0;
}

/* One decoder layer of imggen.model.Block (its weights as imggen.decode.panels packs them) and its cache's
 * read plan (imggen.decode.Cache): position t takes slot slots[t] (recorded in positions[slot]) and
 * its query reads either the slots [0, hi[t]) (hi not NULL: an unmasked ring), or row t - t0 of a
 * plan that covers the steps [t0, t1): index NULL (slots [0, nread)) or (t1 - t0, index_heads, nread)
 * slots, bias NULL or (t1 - t0, bias_heads, nread) additive. */
typedef struct {
    const float *ln1_w, *ln1_b, *qkv, *qkv_b, *proj, *proj_b, *ln2_w, *ln2_b, *fc1, *fc1_b, *fc2, *fc2_b;
    float eps1, eps2;
    int hidden;
    float *k, *v;
    int64_t length;
    const int64_t *slots, *hi;
    int64_t *positions;
    int64_t t0, t1, nread;
    const int64_t *index;
    const float *bias;
    int index_heads, bias_heads;
} imggen_layer;

/* The model around the layers (imggen.model.ImageTransformer): embeddings (rows of dim floats),
 * the (3, n) row / column / channel of each position, the final LayerNorm and the head's panels. */
typedef struct {
    const float *tok, *start, *row, *col, *chan;
    const int64_t *pos;
    int64_t n;
    const float *lnf_w, *lnf_b;
    float eps;
    const float *head, *head_b;
    int vocab, out; /* token values; the head's outputs (vocab logits, or a mixture's parameters) */
} imggen_model;

/* x (B, dim) <- the n layers applied in order at decode step t:
 *   x = x + proj(attend(qkv(LN1(x)))); x = x + fc2(GELU(fc1(LN2(x)))),
 * storing each layer's new key and value in its cache. Returns 0, or -1 if out of memory. */
static int blocks(const imggen_layer *layers, int n, int64_t t, float *x, int B, int dim, int H) {
    int hidden = 0;
    for (int i = 0; i < n; i++) hidden = layers[i].hidden > hidden ? layers[i].hidden : hidden;
    float *qkv = malloc(sizeof(float) * B * 3 * dim), *att = malloc(sizeof(float) * B * dim);
    float *x2 = malloc(sizeof(float) * B * dim), *h = malloc(sizeof(float) * B * (hidden > 0 ? hidden : 1));
    int rc = qkv && att && x2 && h ? 0 : -1;
    for (int i = 0; i < n && rc == 0; i++) {
        const imggen_layer *l = &layers[i];
        int D = dim / H;
        int64_t slot = l->slots[t], row = t - l->t0, nread = l->hi ? l->hi[t] : l->nread;
        const int64_t *index = l->hi || !l->index ? NULL : l->index + row * l->index_heads * nread;
        const float *bias = l->hi || !l->bias ? NULL : l->bias + row * l->bias_heads * nread;
        l->positions[slot] = t;
        rc |= imggen_linear(x, B, dim, dim, l->ln1_w, l->ln1_b, l->eps1, l->qkv, l->qkv_b, 3 * dim, 0, NULL, qkv);
        rc |= imggen_attend(qkv, qkv + dim, qkv + 2 * dim, 3 * dim, slot, l->k, l->v, B, H, l->length, D,
                            index, l->index_heads, nread, bias, l->bias_heads, att);
        rc |= imggen_linear(att, B, dim, dim, NULL, NULL, 0.0f, l->proj, l->proj_b, dim, 0, x, x2);
        rc |= imggen_linear(x2, B, dim, dim, l->ln2_w, l->ln2_b, l->eps2, l->fc1, l->fc1_b, l->hidden, 1, NULL, h);
        rc |= imggen_linear(h, B, l->hidden, l->hidden, NULL, NULL, 0.0f, l->fc2, l->fc2_b, dim, 0, x2, x);
    }
    free(qkv);
    free(att);
    free(x2);
    free(h);
    return rc;
}

/* One decode step of the whole model: x (B, dim) <- the input at position t (the start vector at
 * t = 0, else the embedding of prev[b * prev_stride], plus the position's row, column and channel
 * embeddings, plus features (B rows ldf apart) when not NULL, summed in imggen.model's order), the
 * layers, then logits (B, out) = head(LN_f(x)). Returns 0, -1 if out of memory, -2 for a token
 * outside 0..vocab-1 (nothing written). */
int imggen_step(const imggen_layer *layers, int n, const imggen_model *m, int64_t t, const int64_t *prev,
                int64_t prev_stride, const float *features, int64_t ldf, float *x, float *logits, int B, int dim,
                int H) {
    const float *row = m->row + m->pos[t] * dim, *col = m->col + m->pos[m->n + t] * dim;
    const float *chan = m->chan + m->pos[2 * m->n + t] * dim;
    for (int b = 0; t > 0 && b < B; b++)
        if (prev[b * prev_stride] < 0 || prev[b * prev_stride] >= m->vocab) return -2;
    for (int b = 0; b < B; b++) {
        const float *e = t == 0 ? m->start : m->tok + prev[b * prev_stride] * dim;
        float *xb = x + (int64_t)b * dim;
        for (int d = 0; d < dim; d++) {
            xb[d] = e[d] + ((row[d] + col[d]) + chan[d]);
            if (features) xb[d] += features[b * ldf + d];
        }
    }
    if (blocks(layers, n, t, x, B, dim, H)) return -1;
    return imggen_linear(x, B, dim, dim, m->lnf_w, m->lnf_b, m->eps, m->head, m->head_b, m->out, 0, NULL, logits);
}

/* One sampling draw per row b of logits (B, V) (imggen.sampling._pick and _loglik): the token is the
 * argmax when greedy, else the inverse CDF of softmax(logits / temperature) at u[b * us] (the first
 * token whose cumulative probability exceeds u times the total, kept below the top); a row with
 * mask[b * ks] set takes known[b * ks] instead. Writes tokens[b * ts] and adds the token's
 * log-probability under softmax(logits) to logp[b]. Returns 0, or -1 if out of memory. */
int imggen_draw(const float *logits, int B, int V, const float *u, int64_t us, float temperature, int greedy,
                 const int64_t *known, const uint8_t *mask, int64_t ks, int64_t *tokens, int64_t ts, float *logp) {
    float *cdf = malloc(sizeof(float) * V);
    if (!cdf) return -1;
    for (int b = 0; b < B; b++) {
        const float *l = logits + (int64_t)b * V;
        float top = l[0];
        for (int i = 1; i < V; i++) top = l[i] > top ? l[i] : top;
        int best = 0;  /* the first maximum, as torch.argmax */
        while (best < V - 1 && l[best] != top) best++;
        int64_t tok = best;
        if (mask && mask[b * ks]) {
            tok = known[b * ks];
        } else if (!greedy) {
            float mx = l[best] / temperature, sum = 0.0f, run = 0.0f;
            int i = 0;
            for (; i + 16 <= V; i += 16) {
                v16 e = vexp(load16(l + i) / temperature - mx);
                store16(cdf + i, e);
                sum += hsum(e);
            }
            for (; i < V; i++) sum += cdf[i] = expf(l[i] / temperature - mx);
            for (i = 0; i + 16 <= V; i += 16) store16(cdf + i, load16(cdf + i) / sum);
            for (; i < V; i++) cdf[i] /= sum;
            for (i = 0; i < V; i++) cdf[i] = run += cdf[i];
            float x = fminf(u[b * us] * run, nextafterf(run, 0.0f));
            int lo = 0, hi = V - 1;  /* the first i with cdf[i] > x (cdf[V - 1] = run > x) */
            while (lo < hi) {
                int mid = (lo + hi) / 2;
                if (cdf[mid] > x) hi = mid;
                else lo = mid + 1;
            }
            tok = lo;
        }
        float sum = 0.0f;
        int i = 0;
        for (; i + 16 <= V; i += 16) sum += hsum(vexp(load16(l + i) - l[best]));
        for (; i < V; i++) sum += expf(l[i] - l[best]);
        tokens[b * ts] = tok;
        logp[b] += l[tok] - l[best] - logf(sum);
    }
    free(cdf);
    return 0;
}
