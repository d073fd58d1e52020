// The learner's per-token log-probabilities from its lm_head logits, for x86-64 with AVX2 + FMA
// (see README.md beside this file). A chunk of 512 response tokens over a 49k vocabulary is a
// [512, 49152] tensor; PyTorch's logsumexp, log-softmax and entropy, and their backward, pass
// over it once per op (each pass a new 100 MB fp32 tensor: .float(), / T, - max, exp, sum,
// * ...), longer than the lm_head GEMMs take (benchmarks/step_time.py, the update phase). Here
// the forward reads each row twice while it sits in L2 (a 49k-row of bf16 is 96 KiB) and
// writes three numbers; the backward reads it once and writes the gradient once, in the
// logits' dtype.
// Rows are independent: each is one thread's, so a row's results never depend on the batch.

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

// 8 logits of a row as fp32: bf16 bits widened (exact), or fp32 loaded; / T where T != 1
// (a true division, as torch's logits.float() / T).
INLINE __m256 load8(const void* z, int bf16, int64_t i, __m256 t, int divide) {
    __m256 v;
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)z + i));
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
        v = _mm256_loadu_ps((const float*)z + i);
    }
    return divide ? _mm256_div_ps(v, t) : v;
}

INLINE float load1(const void* z, int bf16, int64_t i, float t, int divide) {
    float v;
    if (bf16) {
        uint32_t u = (uint32_t)((const uint16_t*)z)[i] << 16;
        memcpy(&v, &u, sizeof v);
    } else {
        v = ((const float*)z)[i];
    }
    return divide ? v / t : v;
}

// dz[i] = d, in fp32 or rounded to the nearest bf16 (ties to even)
INLINE void store1(void* dz, int bf16, int64_t i, float d) {
    if (bf16) {
        d = qarl_round_bf16(d);
        uint32_t u;
        memcpy(&u, &d, sizeof u);
        ((uint16_t*)dz)[i] = (uint16_t)(u >> 16);
    } else {
        ((float*)dz)[i] = d;
    }
}

INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

// For each row c of logits z [C, V] (fp32, or bf16 bits when bf16; row stride ld), x = z / T:
// logz[c] = log sum_v exp(x_v) (max-shifted), logp[c] = x[tokens[c]] - logz[c] and
// entropy[c] = logz[c] - sum_v softmax(x)_v x_v. Sums in fp32, 8 lanes then the tail.
void qarl_token_logp(const void* z, int bf16, int64_t C, int64_t V, int64_t ld,
                     const int64_t* tokens, float temperature, float* logp, float* entropy,
                     float* logz, int nthreads) {
    const int divide = temperature != 1.f;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < C; c++) {
        const void* row = bf16 ? (const void*)((const uint16_t*)z + c * ld)
                               : (const void*)((const float*)z + c * ld);
        const __m256 t = _mm256_set1_ps(temperature);
        __m256 vm = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= V; i += 8) vm = _mm256_max_ps(vm, load8(row, bf16, i, t, divide));
        float m = hmax(vm);
        for (; i < V; i++) {
            float v = load1(row, bf16, i, temperature, divide);
            m = v > m ? v : m;
        }
        const __m256 vmax = _mm256_set1_ps(m);
        __m256 se = _mm256_setzero_ps(), sx = _mm256_setzero_ps();
        for (i = 0; i + 8 <= V; i += 8) {
            __m256 x = load8(row, bf16, i, t, divide);
            __m256 e = exp_ps(_mm256_sub_ps(x, vmax));
            se = _mm256_add_ps(se, e);
            sx = _mm256_fmadd_ps(e, _mm256_sub_ps(x, vmax), sx);  // shifted: no cancellation
        }
        float s = hsum(se), sxs = hsum(sx);
        for (; i < V; i++) {
            float x = load1(row, bf16, i, temperature, divide) - m;
            float e = expf(x);
            s += e;
            sxs += e * x;
        }
        float lse = logf(s);  // log sum exp(x - m)
        logz[c] = m + lse;
        logp[c] = load1(row, bf16, tokens[c], temperature, divide) - logz[c];
        // H = log Z - E_p[x] = lse - E_p[x - m]
        entropy[c] = lse - sxs / s;
    }
}

// The gradient of sum_c g[c] logp[c] with respect to the logits z of qarl_token_logp:
// dz[c, v] = (g[c] / T) ([v == tokens[c]] - exp(x_v - logz[c])), written in the logits'
// dtype (fp32, or bf16 rounded to nearest even, as torch rounds the fp32 gradient of
// logits.float()); dz row stride ldd.
void qarl_token_logp_backward(const void* z, int bf16, int64_t C, int64_t V, int64_t ld,
                              const int64_t* tokens, float temperature, const float* logz,
                              const float* g, void* dz, int64_t ldd, int nthreads) {
    const int divide = temperature != 1.f;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < C; c++) {
        const void* row = bf16 ? (const void*)((const uint16_t*)z + c * ld)
                               : (const void*)((const float*)z + c * ld);
        const __m256 t = _mm256_set1_ps(temperature), lz = _mm256_set1_ps(logz[c]);
        const float gc = divide ? g[c] / temperature : g[c];
        const __m256 ng = _mm256_set1_ps(-gc);
        int64_t i = 0;
        for (; i + 8 <= V; i += 8) {
            __m256 d = _mm256_mul_ps(ng, exp_ps(_mm256_sub_ps(load8(row, bf16, i, t, divide), lz)));
            if (bf16) {
                __m256i u = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_ps(d)), 16);
                __m128i h = _mm256_castsi256_si128(
                    _mm256_permute4x64_epi64(_mm256_packus_epi32(u, _mm256_setzero_si256()), 0x08));
                _mm_storeu_si128((__m128i*)((uint16_t*)dz + c * ldd + i), h);
            } else {
                _mm256_storeu_ps((float*)dz + c * ldd + i, d);
            }
        }
        for (; i < V; i++)
            store1(dz, bf16, c * ldd + i, -gc * expf(load1(row, bf16, i, temperature, divide) - logz[c]));
        // the chosen token's entry, computed afresh: (g / T) (1 - p)
        int64_t y = tokens[c];
        float p = expf(load1(row, bf16, y, temperature, divide) - logz[c]);
        store1(dz, bf16, c * ldd + y, gc * (1.f - p));
    }
}
