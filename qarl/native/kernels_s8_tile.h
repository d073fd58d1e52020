// The int8 GEMM's tile and panel loop for one instruction set. kernels_s8.c includes this file
// once per set, with S8_NAME(x) (the functions' names), S8_TARGET (gcc's target attribute)
// and S8_DOT4(c, a, absa, wv) (c += the exact int32 sums of 4 products a[k] * w[n, k] for the
// 8 columns of wv) defined. No include guard: it is meant to be included several times.

// y[r, n] = (float(sum_k x[r, k] w[n, k]) * xs[r]) * ws[n]: the exact int32 sum converted once
// (round to nearest even, like torch's .float()), then the two scale products in that order.
// x rows of Kq * 4 int8 (zero padded). Named accumulators: an array would be kept in memory;
// mr is a constant at every call (the switch below), so the unused ones disappear.
__attribute__((target(S8_TARGET), always_inline)) static inline void S8_NAME(tile)(
    int mr, int64_t Kq, const int8_t* x, int64_t ldx, const int8_t* w, int nc, const float* xs,
    const float* ws, const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;  // the AVX2 dot product widens by it; the VNNI ones need none
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
            c21 = c00, c30 = c00, c31 = c00;
    for (int64_t kq = 0; kq < Kq; kq++) {
        const int8_t* wk = w + kq * NR8 * 4;
        __m256i w0 = _mm256_loadu_si256((const __m256i*)wk);
        __m256i w1 = _mm256_loadu_si256((const __m256i*)(wk + 32));
        __m256i a = _mm256_set1_epi32(load4(x + 4 * kq)), absa = _mm256_abs_epi8(a);
        S8_DOT4(c00, a, absa, w0);
        S8_DOT4(c01, a, absa, w1);
        if (mr > 1) {
            a = _mm256_set1_epi32(load4(x + ldx + 4 * kq)), absa = _mm256_abs_epi8(a);
            S8_DOT4(c10, a, absa, w0);
            S8_DOT4(c11, a, absa, w1);
        }
        if (mr > 2) {
            a = _mm256_set1_epi32(load4(x + 2 * ldx + 4 * kq)), absa = _mm256_abs_epi8(a);
            S8_DOT4(c20, a, absa, w0);
            S8_DOT4(c21, a, absa, w1);
        }
        if (mr > 3) {
            a = _mm256_set1_epi32(load4(x + 3 * ldx + 4 * kq)), absa = _mm256_abs_epi8(a);
            S8_DOT4(c30, a, absa, w0);
            S8_DOT4(c31, a, absa, w1);
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
__attribute__((target(S8_TARGET))) static void S8_NAME(panels)(
    const int8_t* x, int64_t M, int64_t Kq, int64_t ld, const float* xs, const int8_t* wp,
    const float* ws, int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
    int64_t ldy) {
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
                case 4: S8_NAME(tile)(4, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
                case 3: S8_NAME(tile)(3, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
                case 2: S8_NAME(tile)(2, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
                default: S8_NAME(tile)(1, Kq, xm, ld, wpp, nc, xs + m0, ws + n0, b, rm, ldr, ym, ldy); break;
            }
        }
    }
}
