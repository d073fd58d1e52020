// Small AVX2 helpers shared by qarl's C files (see README.md beside this file).
#pragma once

#include <immintrin.h>
#include <math.h>

#define INLINE static inline __attribute__((always_inline))

// exp(x) (Cephes' single-precision range reduction and polynomial, ~1 ulp). Inputs below
// -87.3 give 0 or a subnormal, like the true value; above 88.37 (where the float result
// overflows or nearly does) +inf.
INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.3762626647949f));
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
    // 2^n as a float: n + 127 in the exponent field (n = 128 gives the all-ones field: +inf)
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// sum of x[i]^2 over n floats, in a fixed order (8 lanes x 2 accumulators, then the tail):
// the same bits for the same row wherever it sits in a batch.
INLINE float sum_squares(const float* x, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    if (i + 8 <= n) {
        __m256 v0 = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(v0, v0, a0);
        i += 8;
    }
    float s = hsum(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

// out[i] = w[i] * (x[i] * r) for r = 1 / sqrt(mean(x^2) + eps): RMSNorm's formula and order of
// products (qarl.model.decoder.RMSNorm); w NULL for no weight. out may alias x.
INLINE void rms_norm_row(const float* x, int64_t n, const float* w, float eps, float* out) {
    float r = 1.f / sqrtf(sum_squares(x, n) / (float)n + eps);
    __m256 vr = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vr);
        if (w) v = _mm256_mul_ps(_mm256_loadu_ps(w + i), v);
        _mm256_storeu_ps(out + i, v);
    }
    for (; i < n; i++) out[i] = w ? w[i] * (x[i] * r) : x[i] * r;
}

// fp32 -> the nearest bf16 (ties to even) as fp32, 8 lanes: qarl_round_bf16's integer steps
// (kernels.c), the NaN lanes blended in.
INLINE __m256 round_bf16_ps(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}
