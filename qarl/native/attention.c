// qarl's one-query decode attention for x86-64 with AVX2 + FMA (see README.md beside this
// file). Built into the same library as kernels.c by build.py.

#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

// Attention for one decode query per sequence (T = 1).
//
// SDPA's CPU kernel is built for long query blocks; for one query over a strided KV-cache
// slice its set-up costs many times the arithmetic (benchmarks/quant_kernels.py --parts blocks
// times the engine's blocks). Here each (sequence, head) is one small loop: scores q . k_s *
// scale over the keys the mask allows, a softmax with the max subtracted, then the
// probability-weighted sum of values. Query head h reads key/value head h / (H / Hkv), as
// grouped-query attention (and SDPA's enable_gqa) does.

// Raw score of one key: q . k over D (a multiple of 8), two accumulators so that the chain of
// fmas is half as long.
INLINE float dot_qk(const float* q, const float* k, int64_t D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
    }
    if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    return hsum(_mm256_add_ps(a0, a1));
}

// o[d0 : d0 + 8 nb] = sum_s p[s] v[s, d0 : ...] for up to 8 vectors of D, keys outermost so that
// the 8 accumulators advance together (one fma chain per vector would wait on itself).
INLINE void weighted_values(const float* p, int64_t S, const float* v, int64_t v_ss, int nb,
                            float scale, float* o) {
    __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0, o4 = o0, o5 = o0, o6 = o0, o7 = o0;
    for (int64_t s = 0; s < S; s++) {
        if (p[s] == 0.f) continue;  // masked (or underflowed) keys add nothing
        __m256 w = _mm256_set1_ps(p[s]);
        const float* vs = v + s * v_ss;
        o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs), o0);
        if (nb > 1) o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 8), o1);
        if (nb > 2) o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 16), o2);
        if (nb > 3) o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 24), o3);
        if (nb > 4) o4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 32), o4);
        if (nb > 5) o5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 40), o5);
        if (nb > 6) o6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 48), o6);
        if (nb > 7) o7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + 56), o7);
    }
    __m256 sc = _mm256_set1_ps(scale);
    __m256 res[8] = {o0, o1, o2, o3, o4, o5, o6, o7};
    for (int j = 0; j < nb; j++) _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(res[j], sc));
}

// oh[D] = attention of one query qh[D] over the S keys kh / values vh (slot strides k_ss,
// v_ss; unit stride along D, D a multiple of 8), keys where mb[s] == 0 skipped (mb NULL: all);
// p: scratch of S rounded up to 8 floats.
INLINE void attend_one(const float* qh, const float* kh, int64_t k_ss, const float* vh,
                       int64_t v_ss, const uint8_t* mb, int64_t S, int64_t D, float scale,
                       float* p, float* oh) {
    int64_t S8 = (S + 7) / 8 * 8;
    float best = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        p[s] = (mb && !mb[s]) ? -INFINITY : dot_qk(qh, kh + s * k_ss, D) * scale;
        best = p[s] > best ? p[s] : best;
    }
    for (int64_t s = S; s < S8; s++) p[s] = -INFINITY;
    // p = exp(score - max), exactly 0 for masked slots; their sum
    __m256 vbest = _mm256_set1_ps(best), vsum = _mm256_setzero_ps();
    __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t s = 0; s < S8; s += 8) {
        __m256 sc = _mm256_loadu_ps(p + s);
        __m256 keep = _mm256_cmp_ps(sc, ninf, _CMP_NEQ_OQ);
        __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(sc, vbest)), keep);
        _mm256_storeu_ps(p + s, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float inv = 1.f / hsum(vsum);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        int nb = (int)((D - d0) / 8 < 8 ? (D - d0) / 8 : 8);
        weighted_values(p, S, vh + d0, v_ss, nb, inv, oh + d0);
    }
}

// out [B, H, D] = attention of q [B, H, D] (contiguous) over keys/values k, v (element strides
// per sequence, head and slot; unit stride along D, D a multiple of 8) of S slots; mask [B', S]
// bytes (1 = may attend; B' = B, or 1 with mask_sb = 0) or NULL for all. The (sequence, head)
// pairs are shared among the threads of the enclosing region; p: this thread's scratch of S
// rounded up to 8 floats.
static void attend_heads(const float* q, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                         const float* k, int64_t k_sb, int64_t k_sh, int64_t k_ss,
                         const float* v, int64_t v_sb, int64_t v_sh, int64_t v_ss, int64_t S,
                         const uint8_t* mask, int64_t mask_sb, float scale, float* p, float* out) {
    int64_t group = H / Hkv;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < H; h++) {
            attend_one(q + (b * H + h) * D, k + b * k_sb + (h / group) * k_sh, k_ss,
                       v + b * v_sb + (h / group) * v_sh, v_ss, mask ? mask + b * mask_sb : 0,
                       S, D, scale, p, out + (b * H + h) * D);
        }
    }
}

// x[D] -> RoPE-rotated into out[D] (HF's non-interleaved "rotate_half" layout):
// out[d] = x[d] cos[d] + (-x[d + D/2]) sin[d] for d < D/2, x[d] cos[d] + x[d - D/2] sin[d]
// after. Two products and a sum, each rounded (built with -ffp-contract=off): the same bits as
// `x * cos + rotate_half(x) * sin` in PyTorch.
INLINE void rope_row(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
    int64_t half = D / 2;
    for (int64_t d = 0; d < half; d++) out[d] = x[d] * cos[d] + (-x[d + half]) * sin[d];
    for (int64_t d = half; d < D; d++) out[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

void qarl_attention_step(const float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                         const float* qn_w, const float* kn_w, float eps, const float* cos,
                         const float* sin, int64_t cs_sb, float* kc, float* vc, int64_t c_sb,
                         int64_t c_sh, int64_t c_ss, int64_t slot, const uint8_t* mask,
                         int64_t mask_sb, float scale, float* q_buf, float* out, float* p) {
    int64_t S = slot + 1, W = (H + 2 * Hkv) * D;
    // q heads into q_buf [B, H, D]; k and v heads into the cache
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < H + 2 * Hkv; j++) {
            const float* src = qkv + b * W + j * D;
            const float *c = cos + b * cs_sb, *s = sin + b * cs_sb;
            if (j < H) {
                const float* x = src;
                if (qn_w) { rms_norm_row(src, D, qn_w, eps, p); x = p; }
                rope_row(x, c, s, D, q_buf + (b * H + j) * D);
            } else if (j < H + Hkv) {
                const float* x = src;
                if (kn_w) { rms_norm_row(src, D, kn_w, eps, p); x = p; }
                rope_row(x, c, s, D, kc + b * c_sb + (j - H) * c_sh + slot * c_ss);
            } else {
                float* dst = vc + b * c_sb + (j - H - Hkv) * c_sh + slot * c_ss;
                for (int64_t d = 0; d < D; d++) dst[d] = src[d];
            }
        }
    }
    // (the implicit barrier: every k / v of this step is in the cache)
    attend_heads(q_buf, B, H, Hkv, D, kc, c_sb, c_sh, c_ss, vc, c_sb, c_sh, c_ss, S, mask, mask_sb,
                 scale, p, out);
}

// One decoder layer's attention for one new token per sequence, after the q/k/v projection:
//   qkv [B, (H + 2 Hkv) D] (contiguous: q heads, k heads, v heads) ->
//   q, k per-head RMSNorm (Qwen3; qn_w / kn_w NULL: none) -> RoPE (cos / sin rows [D] at
//   stride cs_sb per sequence, 0 to share one row) -> k, v written into the cache at `slot`
//   (kc / vc: this layer's cache, strides per sequence, head and slot) -> out [B, H D], the
//   attention of q over cache slots 0..slot, keys where mask [B', slot + 1] is 0 skipped.
void qarl_decode_attention(const float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                           const float* qn_w, const float* kn_w, float eps,
                           const float* cos, const float* sin, int64_t cs_sb,
                           float* kc, float* vc, int64_t c_sb, int64_t c_sh, int64_t c_ss,
                           int64_t slot, const uint8_t* mask, int64_t mask_sb, float scale,
                           float* q_buf, float* out, int nthreads) {
    int64_t S8 = (slot + 1 + 7) / 8 * 8;
#pragma omp parallel num_threads(nthreads) if (B * (slot + 1) * H * D > 16384)
    {
        float* p = (float*)malloc(sizeof(float) * (size_t)(S8 > D ? S8 : D));
        qarl_attention_step(qkv, B, H, Hkv, D, qn_w, kn_w, eps, cos, sin, cs_sb, kc, vc, c_sb,
                            c_sh, c_ss, slot, mask, mask_sb, scale, q_buf, out, p);
        free(p);
    }
}
