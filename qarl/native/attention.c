// qarl's one-query decode attention for x86-64 with AVX2 + FMA (see README.md beside this
// file). Built into the same library as kernels.c by build.py.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))

// Attention for one decode query per sequence (T = 1).
//
// SDPA's CPU kernel is built for long query blocks; for one query over a strided KV-cache
// slice it spends ~0.3 ms per layer at batch 16 on work worth ~20 us. Here each (sequence,
// head) is one small loop: scores q . k_s * scale over the keys the mask allows, a softmax
// with the max subtracted, then the probability-weighted sum of values. Query head h reads
// key/value head h / (H / Hkv), as grouped-query attention (and SDPA's enable_gqa) does.

// exp(x) for x <= 0 (Cephes' single-precision range reduction and polynomial, ~1 ulp);
// inputs below -87.3 give 0 or a subnormal, like the true value.
INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

// out [B, H, D] = attention of q [B, H, D] (contiguous) over keys/values k, v (element strides
// per sequence, head and slot; unit stride along D, D a multiple of 8) of S slots; mask [B', S]
// bytes (1 = may attend; B' = B, or 1 with mask_sb = 0) or NULL for all.
void qarl_attend_decode(const float* q, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                        const float* k, int64_t k_sb, int64_t k_sh, int64_t k_ss,
                        const float* v, int64_t v_sb, int64_t v_sh, int64_t v_ss, int64_t S,
                        const uint8_t* mask, int64_t mask_sb, float scale, float* out,
                        int nthreads) {
    int64_t group = H / Hkv, S8 = (S + 7) / 8 * 8;
#pragma omp parallel num_threads(nthreads)
    {
        float* p = (float*)malloc(sizeof(float) * (size_t)(S8 > 0 ? S8 : 8));
#pragma omp for collapse(2) schedule(static)
        for (int64_t b = 0; b < B; b++) {
            for (int64_t h = 0; h < H; h++) {
                const float* qh = q + (b * H + h) * D;
                const float* kh = k + b * k_sb + (h / group) * k_sh;
                const float* vh = v + b * v_sb + (h / group) * v_sh;
                const uint8_t* mb = mask ? mask + b * mask_sb : 0;
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
                float* oh = out + (b * H + h) * D;
                for (int64_t d0 = 0; d0 < D; d0 += 64) {
                    int nb = (int)((D - d0) / 8 < 8 ? (D - d0) / 8 : 8);
                    weighted_values(p, S, vh + d0, v_ss, nb, inv, oh + d0);
                }
            }
        }
        free(p);
    }
}
