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

// The tile and its panel loop, once per instruction set (kernels_s8_tile.h): AVX2 as described
// above, and VNNI, where vpdpbusd multiplies u8 x s8 and adds each group of 4 products to an
// int32 lane without intermediate saturation: with the sign moved onto the weight as above, one
// instruction does what vpmaddubsw + vpmaddwd + vpaddd do in AVX2. The sums are the same exact
// integers, so every set gives the same bits (tested); only the speed differs.

// c += the exact int32 sums of 4 products a[k] * w[n, k] for the 8 columns of wv.
#define S8_DOT4(c, a, absa, wv) \
    c = _mm256_add_epi32(c, _mm256_madd_epi16(_mm256_maddubs_epi16(absa, _mm256_sign_epi8(wv, a)), ones))
#define S8_NAME(x) x##_avx2
#define S8_TARGET "avx2,fma"
#include "kernels_s8_tile.h"
#undef S8_DOT4
#undef S8_NAME
#undef S8_TARGET

#define S8_DOT4(c, a, absa, wv) c = _mm256_dpbusd_epi32(c, absa, _mm256_sign_epi8(wv, a))
#define S8_NAME(x) x##_avx512vnni
#define S8_TARGET "avx2,fma,avx512f,avx512vl,avx512vnni"
#include "kernels_s8_tile.h"
#undef S8_DOT4
#undef S8_NAME
#undef S8_TARGET

#define S8_DOT4(c, a, absa, wv) c = _mm256_dpbusd_avx_epi32(c, absa, _mm256_sign_epi8(wv, a))
#define S8_NAME(x) x##_avxvnni
#define S8_TARGET "avx2,fma,avxvnni"
#include "kernels_s8_tile.h"
#undef S8_DOT4
#undef S8_NAME
#undef S8_TARGET

// Which int8 arithmetic qarl_s8_panels runs: S8_AVX2, or a VNNI one where the CPU has it
// (chosen at the first call from the CPU's own flags; qarl_s8_set_isa overrides, for tests).
enum { S8_AUTO = -1, S8_AVX2 = 0, S8_AVXVNNI = 1, S8_AVX512VNNI = 2 };
static int s8_isa = S8_AUTO;

int qarl_s8_isa(void) {
    if (s8_isa == S8_AUTO) {
        __builtin_cpu_init();
        s8_isa = (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
                     ? S8_AVX512VNNI
                 : __builtin_cpu_supports("avxvnni") ? S8_AVXVNNI
                                                     : S8_AVX2;
    }
    return s8_isa;
}

// Force the int8 arithmetic (S8_AVX2 always runs; a VNNI level only where the CPU has it);
// returns the level now in use.
int qarl_s8_set_isa(int isa) {
    int best = (s8_isa = S8_AUTO, qarl_s8_isa());
    s8_isa = isa < S8_AVX2 ? best : (isa > best ? best : isa);
    if (isa == S8_AVXVNNI && best == S8_AVX512VNNI) s8_isa = S8_AVX512VNNI;  // a superset
    return s8_isa;
}

void qarl_s8_panels(const int8_t* x, int64_t M, int64_t Kq, int64_t ld, const float* xs,
                    const int8_t* wp, const float* ws, int64_t N, const float* bias,
                    const float* res, int64_t ldr, float* y, int64_t ldy) {
    switch (qarl_s8_isa()) {
        case S8_AVX512VNNI:
            panels_avx512vnni(x, M, Kq, ld, xs, wp, ws, N, bias, res, ldr, y, ldy);
            break;
        case S8_AVXVNNI:
            panels_avxvnni(x, M, Kq, ld, xs, wp, ws, N, bias, res, ldr, y, ldy);
            break;
        default:
            panels_avx2(x, M, Kq, ld, xs, wp, ws, N, bias, res, ldr, y, ldy);
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

// Rows of x [M, K] (row stride ldx) quantized as above, in parallel over rows: codes [M, K]
// (row stride ldq), scales [M]. The same bits as numerics.int8_rows, in one pass per row.
void qarl_quantize_s8_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q,
                           int64_t ldq, float* scales, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) qarl_quantize_row_s8(x + m * ldx, K, q + m * ldq, scales + m);
}

// Rows of x [M, K] times per-column factors cs [K], quantized as above: the codes and scales
// numerics.int8_rows gives for x * cs[None, :] (each product rounded once, as torch's), without
// writing that product out. For a straight-through backward's dL/dx on int8 weight codes.
void qarl_quantize_s8_rows_scaled(const float* x, int64_t M, int64_t K, int64_t ldx,
                                  const float* cs, int8_t* q, int64_t ldq, float* scales,
                                  int nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        float* row = (float*)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float* xm = x + m * ldx;
            for (int64_t k = 0; k < K; k++) row[k] = xm[k] * cs[k];
            qarl_quantize_row_s8(row, K, q + m * ldq, scales + m);
        }
        free(row);
    }
}

// y[m, n] = ((float)acc[m, n] * xs[m]) * ws[n]: an exact int32 GEMM result scaled as the
// kernels above scale it (two rounded products, in that order), in one pass; with ws NULL,
// (float)acc[m, n] * xs[m].
void qarl_scale_s32(const int32_t* acc, int64_t M, int64_t N, const float* xs, const float* ws,
                    float* y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        const int32_t* a = acc + m * N;
        float* out = y + m * N;
        const float s = xs[m];
        if (ws == 0) {
            for (int64_t n = 0; n < N; n++) out[n] = (float)a[n] * s;
        } else {
            for (int64_t n = 0; n < N; n++) out[n] = ((float)a[n] * s) * ws[n];
        }
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
