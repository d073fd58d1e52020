// The small per-token operations of a decoder block, for x86-64 with AVX2 + FMA (see
// README.md beside this file). Each is a handful of microseconds of arithmetic that PyTorch
// spends 5-30 us of dispatch on (F.rms_norm on one 576-wide row: ~30 us); a decode step of a
// 30-layer model runs them ~100 times. Built into the same library as kernels.c by build.py.
// Every output row depends on its own input row only (batch-invariant by construction).

#include <stdint.h>

#include "simd.h"

// out [M, N] = RMSNorm of each row of x [M, N] (row strides ldx, ldo) with weight w [N].
void qarl_rms_norm(const float* x, int64_t M, int64_t N, int64_t ldx, const float* w, float eps,
                   float* out, int64_t ldo, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N > 32768)
    for (int64_t m = 0; m < M; m++) rms_norm_row(x + m * ldx, N, w, eps, out + m * ldo);
}

// out [M, F] = silu(gate) * up for gate_up [M, 2F] (gate columns first), SwiGLU's product.
// silu(g) = g / (1 + exp(-g)), as PyTorch computes it (its own exp: equal to ~1 ulp).
void qarl_silu_mul(const float* gate_up, int64_t M, int64_t F, float* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * F > 32768)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * F, *u = g + F;
        float* o = out + m * F;
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= F; i += 8) {
            __m256 vg = _mm256_loadu_ps(g + i);
            __m256 den = _mm256_add_ps(one, exp_ps(_mm256_sub_ps(zero, vg)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(vg, den), _mm256_loadu_ps(u + i)));
        }
        for (; i < F; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
