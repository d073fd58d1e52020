// qarl's W8A8 int8 GEMM for x86-64 with AVX2 + FMA (see README.md beside this file; the
// fp32 and int4 GEMMs are in kernels.c). Every output element is an exact int32 sum, whatever
// M is: batch-invariant by construction. Built into the same library as kernels.c by build.py.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

#define INLINE static inline __attribute__((always_inline))
// ---------------------------------------------------------------------------------------
// int8 x int8 -> int32 (W8A8)
//
// AVX2 has no VNNI dot product; vpmaddubsw multiplies u8 x s8 and sums pairs into int16,
// which saturates for general int8 x int8. With the sign moved from the activation onto the
// weight (vpsignb) the unsigned operand is |a| <= 128 and the weight stays in [-127, 127], so a
// pair sums to at most 2 * 128 * 127 = 32512 < 2^15: exact. vpmaddwd by ones then widens each
// 4-product sum to int32 (exact for K < 2^31 / 127^2 = 133,000). On the development machine's
// Zen 3 this runs one multiply instruction per cycle, 16 MACs per cycle per core: the fp32 FMA
// peak, with a quarter of the weight bytes.

#define NR8 16  // output columns per int8 panel: 2 vectors of 8 int32
#define MR8 4   // rows per tile: 4 x 2 accumulators + 2 weights + temporaries fit 16 ymm

static int64_t panels8(int64_t n) { return (n + NR8 - 1) / NR8; }

// codes [N, K] int8 in [-127, 127] -> panels [P8][Kq][NR8][4] (Kq = ceil(K / 4)), zero padded.
void qarl_pack_s8(const int8_t* w, int64_t N, int64_t K, int64_t ldw, int8_t* out, int nthreads) {
    int64_t P = panels8(N), Kq = (K + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int8_t* dst = out + p * Kq * 4 * NR8;
        for (int j = 0; j < NR8; j++) {
            int64_t n = p * NR8 + j;
            for (int64_t k = 0; k < Kq * 4; k++) {
                int8_t v = (n < N && k < K) ? w[n * ldw + k] : 0;
                dst[(k / 4) * NR8 * 4 + j * 4 + (k & 3)] = v;
            }
        }
    }
}

INLINE int32_t load4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

// c += the exact int32 sums of 4 products a[k] * w[n, k] for the 8 columns of wv.
#define DOT4(c, a, absa, wv) \
    c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(absa, _mm256_sign_epi8(wv, a)), ones))

// y[r, n] = (float(sum_k x[r, k] w[n, k]) * xs[r]) * ws[n]: the exact int32 sum converted once
// (round to nearest even, like torch's .float()), then the two scale products in that order.
// x rows of Kq * 4 int8 (zero padded). Named accumulators: an array would be kept in memory.
INLINE void tile_s8(int mr, int64_t Kq, const int8_t* x, int64_t ldx, const int8_t* w, int nc,
                    const float* xs, const float* ws, const float* bias, const float* res,
                    int64_t ldr, float* y, int64_t ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
            c21 = c00, c30 = c00, c31 = c00;
    for (int64_t kq = 0; kq < Kq; kq++) {
        const int8_t* wk = w + kq * NR8 * 4;
        __m256i w0 = _mm256_loadu_si256((const __m256i*)wk);
        __m256i w1 = _mm256_loadu_si256((const __m256i*)(wk + 32));
        __m256i a = _mm256_set1_epi32(load4(x + 4 * kq)), absa = _mm256_abs_epi8(a);
        DOT4(c00, a, absa, w0);
        DOT4(c01, a, absa, w1);
        if (mr > 1) {
            a = _mm256_set1_epi32(load4(x + ldx + 4 * kq)), absa = _mm256_abs_epi8(a);
            DOT4(c10, a, absa, w0);
            DOT4(c11, a, absa, w1);
        }
        if (mr > 2) {
            a = _mm256_set1_epi32(load4(x + 2 * ldx + 4 * kq)), absa = _mm256_abs_epi8(a);
            DOT4(c20, a, absa, w0);
            DOT4(c21, a, absa, w1);
        }
        if (mr > 3) {
            a = _mm256_set1_epi32(load4(x + 3 * ldx + 4 * kq)), absa = _mm256_abs_epi8(a);
            DOT4(c30, a, absa, w0);
            DOT4(c31, a, absa, w1);
        }
    }
    __m256i acc[MR8][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    __m256 ws0 = _mm256_loadu_ps(ws), ws1 = _mm256_loadu_ps(ws + 8);
    for (int r = 0; r < mr; r++) {
        float tmp[NR8];
        __m256 sx = _mm256_set1_ps(xs[r]);
        _mm256_storeu_ps(tmp, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][0]), sx), ws0));
        _mm256_storeu_ps(tmp + 8, _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][1]), sx), ws1));
        for (int j = 0; j < nc; j++) {  // then (+ bias) (+ residual), in that order
            float v = tmp[j];
            if (bias) v = v + bias[j];
            if (res) v = v + res[r * ldr + j];
            y[r * ldy + j] = v;
        }
    }
}

// The GEMM over rows already padded to whole quads (row stride ld = Kq * 4), its panels shared
// among the threads of the enclosing parallel region (see kernels.h).
void qarl_s8_panels(const int8_t* x, int64_t M, int64_t Kq, int64_t ld, const float* xs,
                    const int8_t* wp, const float* ws, int64_t N, const float* bias,
                    const float* res, int64_t ldr, float* y, int64_t ldy) {
    int64_t P = panels8(N);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int64_t n0 = p * NR8;
        int nc = N - n0 < NR8 ? (int)(N - n0) : NR8;
        const int8_t* wpp = wp + p * Kq * 4 * NR8;
        for (int64_t m0 = 0; m0 < M; m0 += MR8) {
            int mr = M - m0 < MR8 ? (int)(M - m0) : MR8;
            const int8_t* xm = x + m0 * ld;
            float* ym = y + m0 * ldy + n0;
            const float* b = bias ? bias + n0 : 0;
            const float* rm = res ? res + m0 * ldr + n0 : 0;
            switch (mr) {
                case 4: tile_s8(4, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
                case 3: tile_s8(3, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
                case 2: tile_s8(2, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
                default: tile_s8(1, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
            }
        }
    }
}

// One row as numerics.int8_rows quantizes it: s = max|x| / 127 (1 for an all-zero row),
// q = clamp(round_half_even(x / s), -127, 127), with a true division like torch's.
void qarl_quantize_row_s8(const float* x, int64_t K, int8_t* q, float* scale) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 vmax = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, vmax);
    for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
    for (; k < K; k++) {
        float a = x[k] < 0 ? -x[k] : x[k];
        amax = a > amax ? a : amax;
    }
    float s = amax > 0.f ? amax / 127.f : 1.f;
    *scale = s;
    const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    for (k = 0; k + 8 <= K; k += 8) {
        __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vs),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        int32_t c32[8];
        _mm256_storeu_si256((__m256i*)c32, c);
        for (int j = 0; j < 8; j++) q[k + j] = (int8_t)c32[j];
    }
    for (; k < K; k++) {
        float v = __builtin_nearbyintf(x[k] / s);  // the default rounding mode: half to even
        q[k] = (int8_t)(v > 127.f ? 127.f : v < -127.f ? -127.f : v);
    }
}

// The dynamic W8A8 linear in one call: rows of x quantized as above, then the int8 GEMM.
void qarl_linear_s8_dynamic(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* wp,
                            const float* ws, int64_t N, float* y, int64_t ldy, int nthreads) {
    int64_t Kq = (K + 3) / 4, ld = Kq * 4;
    int8_t* xq = (int8_t*)calloc((size_t)(M * ld), 1);
    float* xs = (float*)malloc(sizeof(float) * (size_t)(M > 0 ? M : 1));
    for (int64_t m = 0; m < M; m++) qarl_quantize_row_s8(x + m * ldx, K, xq + m * ld, xs + m);
#pragma omp parallel num_threads(nthreads)
    qarl_s8_panels(xq, M, Kq, ld, xs, wp, ws, N, 0, 0, 0, y, ldy);
    free(xs);
    free(xq);
}
