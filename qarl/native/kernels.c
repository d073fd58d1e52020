// qarl's CPU kernels for x86-64 with AVX2 + FMA, and AVX-512 fp32 tiles where the CPU has
// AVX-512F (see README.md beside this file).
//
// Three GEMMs for the few-row products of decoding: y[M, N] = x[M, K] . w[N, K]^T with w
// pre-packed once into panels of output columns stored k-major, so a panel streams from
// memory in order and is reused from cache by every row tile of x (4 rows; 8 with AVX-512). The fp32 and int4 GEMMs
// (panels of NR = 24 columns) are here, the int8 one in kernels_s8.c.
//
// Every output element is ONE fixed-order chain over k (fp32: an fma chain from k = 0 up;
// int8: an exact int32 sum), whatever M is and whichever tile the row falls in. A row's bits
// therefore never depend on the other rows or on the row count: the kernels are
// batch-invariant by construction, which is what lets the learner replay the engine.
//
// Built by qarl/native/build.py with -O3 -mavx2 -mfma -fopenmp -ffp-contract=off and loaded
// after torch, so the OpenMP runtime (and its threads) is torch's own libgomp.

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define NR 24  // output columns per panel: 3 vectors of 8
#define MR 4   // rows per register tile: 4 x 3 accumulators + 3 weights + 1 broadcast = 16 ymm

static int64_t panels(int64_t n) { return (n + NR - 1) / NR; }

// Store one row of a tile, y = acc (* xs[0]) (+ bias[n]) (+ res[n]) for nc valid columns: the
// product and adds run in that order, after the chain, so they never change the chain's bits.
// The accumulators come by value: passing their array would make the compiler keep them in
// memory.
INLINE void epilogue(const float* tmp, int nc, const float* xs, const float* bias,
                     const float* res, float* y) {
    for (int j = 0; j < nc; j++) {
        float v = tmp[j];
        if (xs) v = v * xs[0];
        if (bias) v = v + bias[j];
        if (res) v = v + res[j];
        y[j] = v;
    }
}

INLINE void store_row(__m256 v0, __m256 v1, __m256 v2, int nc, const float* xs,
                      const float* bias, const float* res, float* y) {
    float tmp[NR];
    _mm256_storeu_ps(tmp, v0);
    _mm256_storeu_ps(tmp + 8, v1);
    _mm256_storeu_ps(tmp + 16, v2);
    epilogue(tmp, nc, xs, bias, res, y);
}

// ---------------------------------------------------------------------------------------
// fp32

// w [N, K] (row stride ldw) -> panels [P][K][NR], columns past N zero.
void qarl_pack_f32(const float* w, int64_t N, int64_t K, int64_t ldw, float* out, int nthreads) {
    int64_t P = panels(N);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        float* dst = out + p * K * NR;
        for (int j = 0; j < NR; j++) {
            int64_t n = p * NR + j;
            if (n < N) {
                for (int64_t k = 0; k < K; k++) dst[k * NR + j] = w[n * ldw + k];
            } else {
                for (int64_t k = 0; k < K; k++) dst[k * NR + j] = 0.f;
            }
        }
    }
}

// y[r, 8j:8j+8] = sum_k x[r, k] * panel[k, 8j:8j+8], one fma per k in increasing k, then
// the epilogue. The accumulators are locals of this function so they live in registers.
INLINE void tile_f32(int mr, int64_t K, const float* x, int64_t ldx, const float* w, int nc,
                     const float* xs, const float* bias, const float* res, int64_t ldr, float* y,
                     int64_t ldy) {
    __m256 acc[MR][3];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 3
        for (int j = 0; j < 3; j++) acc[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const float* wk = w + k * NR;
        __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
                acc[r][0] = _mm256_fmadd_ps(a, w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(a, w1, acc[r][1]);
                acc[r][2] = _mm256_fmadd_ps(a, w2, acc[r][2]);
            }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
        if (r < mr)
            store_row(acc[r][0], acc[r][1], acc[r][2], nc, xs ? xs + r : 0, bias,
                      res ? res + r * ldr : 0, y + r * ldy);
}

// The same chains with AVX-512: per row one zmm (columns 0-15) and one ymm (16-23) of the
// same NR-column panel, and MR512 = 8 rows per tile (16 accumulators + 2 weights + 1
// broadcast). Each output is still one fma per k from k = 0 up on the same operands, and an
// fma rounds once whatever the vector width, so every output has tile_f32's bits; the gain
// is 1.5x the columns per fma instruction and half the passes over each panel.
#define MR512 8

// store_row for a zmm + ymm row (accumulators by value, as there)
__attribute__((target("avx2,fma,avx512f"))) static inline __attribute__((always_inline)) void
store_row512(__m512 v0, __m256 v1, int nc, const float* xs, const float* bias, const float* res,
             float* y) {
    float tmp[NR];
    _mm512_storeu_ps(tmp, v0);
    _mm256_storeu_ps(tmp + 16, v1);
    epilogue(tmp, nc, xs, bias, res, y);
}

// Named accumulators rather than arrays, and one function per row count (generated below):
// inlined into one switch, GCC kept the accumulators on the stack.
#define ROWS512(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define TILE512(MRC)                                                                          \
    __attribute__((target("avx2,fma,avx512f"), noinline)) static void tile_f32_avx512_##MRC(  \
        int64_t K, const float* x, int64_t ldx, const float* w, int nc, const float* xs,      \
        const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy) {            \
        const int mr = MRC;                                                                   \
        ROWS512(ZERO512)                                                                      \
        for (int64_t k = 0; k < K; k++) {                                                     \
            const float* wk = w + k * NR;                                                     \
            __m512 w0 = _mm512_loadu_ps(wk);                                                  \
            __m256 w1 = _mm256_loadu_ps(wk + 16);                                             \
            ROWS512(FMA512)                                                                   \
        }                                                                                     \
        ROWS512(STORE512)                                                                     \
    }
#define ZERO512(r) __m512 lo##r = _mm512_setzero_ps(); __m256 hi##r = _mm256_setzero_ps();
#define FMA512(r)                                                     \
    if (r < mr) {                                                     \
        __m512 a = _mm512_set1_ps(x[r * ldx + k]);                    \
        lo##r = _mm512_fmadd_ps(a, w0, lo##r);                        \
        hi##r = _mm256_fmadd_ps(_mm512_castps512_ps256(a), w1, hi##r); \
    }
#define STORE512(r)                                                                          \
    if (r < mr)                                                                              \
        store_row512(lo##r, hi##r, nc, xs ? xs + r : 0, bias, res ? res + r * ldr : 0,       \
                     y + r * ldy);
TILE512(1) TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6) TILE512(7) TILE512(8)
#undef TILE512
#undef ZERO512
#undef FMA512
#undef STORE512
#undef ROWS512

// One AVX-512 tile of mr <= MR512 rows (panel_f32 below walks the rows).
__attribute__((target("avx2,fma,avx512f"))) static void tile_f32_avx512(
    int mr, int64_t K, const float* x, int64_t ldx, const float* w, int nc, const float* xs,
    const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy) {
    switch (mr) {
#define CASE512(n) case n: tile_f32_avx512_##n(K, x, ldx, w, nc, xs, bias, res, ldr, y, ldy); break;
        CASE512(8) CASE512(7) CASE512(6) CASE512(5) CASE512(4) CASE512(3) CASE512(2)
#undef CASE512
        default: tile_f32_avx512_1(K, x, ldx, w, nc, xs, bias, res, ldr, y, ldy); break;
    }
}

// Which fp32 arithmetic the panels run: F32_AVX2, or F32_AVX512 where the CPU has AVX-512F
// (chosen at the first call from the CPU's flags; qarl_f32_set_isa overrides, for tests).
// Both give the same bits (above), so the choice is speed only.
enum { F32_AUTO = -1, F32_AVX2 = 0, F32_AVX512 = 1 };
static int f32_isa = F32_AUTO;

int qarl_f32_isa(void) {
    if (f32_isa == F32_AUTO) {
        __builtin_cpu_init();
        f32_isa = __builtin_cpu_supports("avx512f") ? F32_AVX512 : F32_AVX2;
    }
    return f32_isa;
}

// Force the fp32 arithmetic (F32_AVX2 always runs; AVX-512 only where the CPU has it);
// returns the level now in use.
int qarl_f32_set_isa(int isa) {
    int best = (f32_isa = F32_AUTO, qarl_f32_isa());
    f32_isa = isa < F32_AVX2 ? best : (isa > best ? best : isa);
    return f32_isa;
}

// All row tiles of x against one packed panel; the switch hands each tile a constant mr
// (the chain is the same for every mr: it only lets the compiler drop dead rows).
INLINE void panel_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* w,
                      int nc, const float* xs, const float* bias, const float* res, int64_t ldr,
                      float* y, int64_t ldy) {
    const int wide = qarl_f32_isa() == F32_AVX512, height = wide ? MR512 : MR;
    for (int64_t m0 = 0; m0 < M; m0 += height) {
        int mr = M - m0 < height ? (int)(M - m0) : height;
        const float* xm = x + m0 * ldx;
        const float* sm = xs ? xs + m0 : 0;
        const float* rm = res ? res + m0 * ldr : 0;
        float* ym = y + m0 * ldy;
        if (wide) {
            tile_f32_avx512(mr, K, xm, ldx, w, nc, sm, bias, rm, ldr, ym, ldy);
            continue;
        }
        switch (mr) {
            case 4: tile_f32(4, K, xm, ldx, w, nc, sm, bias, rm, ldr, ym, ldy); break;
            case 3: tile_f32(3, K, xm, ldx, w, nc, sm, bias, rm, ldr, ym, ldy); break;
            case 2: tile_f32(2, K, xm, ldx, w, nc, sm, bias, rm, ldr, ym, ldy); break;
            default: tile_f32(1, K, xm, ldx, w, nc, sm, bias, rm, ldr, ym, ldy); break;
        }
    }
}

// The panels of one product shared among the threads of the enclosing parallel region (an
// orphaned `omp for`: alone outside a region): see kernels.h.
void qarl_f32_panels(const float* x, int64_t M, int64_t K, int64_t ldx, const float* wp,
                     int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
                     int64_t ldy) {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels(N); p++) {
        int64_t n0 = p * NR;
        int nc = N - n0 < NR ? (int)(N - n0) : NR;
        panel_f32(x, M, K, ldx, wp + p * K * NR, nc, 0, bias ? bias + n0 : 0,
                  res ? res + n0 : 0, ldr, y + n0, ldy);
    }
}

// y[M, N] = x[M, K] . W^T (+ bias[N]) (+ res[M, N]); wp from qarl_pack_f32.
void qarl_linear_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* wp,
                     int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
                     int64_t ldy, int nthreads) {
#pragma omp parallel num_threads(nthreads)
    qarl_f32_panels(x, M, K, ldx, wp, N, bias, res, ldr, y, ldy);
}

// ---------------------------------------------------------------------------------------
// int4 groups (W4A16, W4A8)
//
// Each panel is dequantized into a per-thread fp32 buffer, w = (u - 8) * s (+ z): (u - 8) * s
// is exact in fp32 (4-bit integer times bf16 scale), so fma((u - 8), s, z) rounds once, like
// (u - 8) * s + z does; these are exactly the values of numerics.int4_dequantize. The fp32
// chain above then runs on the buffer: the result equals qarl_linear_f32 on the dequantized
// weight, bit for bit, for every M.

// u [N, K] uint8 in [0, 15] (K even) -> panels [P][K/2][NR], byte j = u[j, 2i] | u[j, 2i+1] << 4.
void qarl_pack_u4(const uint8_t* u, int64_t N, int64_t K, int64_t ldu, uint8_t* out, int nthreads) {
    int64_t P = panels(N);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        uint8_t* dst = out + p * (K / 2) * NR;
        for (int j = 0; j < NR; j++) {
            int64_t n = p * NR + j;
            for (int64_t i = 0; i < K / 2; i++) {
                uint8_t v = 0x88;  // padded columns: (8 - 8) * s = 0
                if (n < N) v = (uint8_t)((u[n * ldu + 2 * i] & 15) | (u[n * ldu + 2 * i + 1] << 4));
                dst[i * NR + j] = v;
            }
        }
    }
}

static uint16_t bf16_bits(float v) {  // v already rounded to bf16: its upper half
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    return (uint16_t)(u >> 16);
}

// w [N, K] fp32 (row stride ldw) -> int4 groups exactly as numerics.int4_groups computes them,
// in one pass per group: s = bf16(max|w| / 7.5) (symmetric) or bf16((max - min) / 15) with
// z = bf16(min + 8 s) (1 where s is not > 0), q = clamp(round_half_even((w [- z]) / s), -8, 7)
// with a true division; codes u = q + 8 packed two per byte (element 2i in the low nibble, as
// numerics.pack_nibbles) into packed [N, K/2]; scales / zeros [N, K/group] as bf16 bits (zeros
// NULL when symmetric); deq [N, K] (NULL: not written) = q * s (+ z), numerics.int4_dequantize's
// values (two rounded operations, no fma: -ffp-contract=off). group: a multiple of 8.
void qarl_quantize_u4(const float* w, int64_t N, int64_t K, int64_t ldw, int64_t group,
                      int symmetric, uint8_t* packed, uint16_t* scales, uint16_t* zeros,
                      float* deq, int nthreads) {
    const int64_t G = K / group;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t g = 0; g < G; g++) {
            const float* x = w + n * ldw + g * group;
            __m256 vmax = _mm256_loadu_ps(x), vmin = vmax;
            for (int64_t k = 8; k < group; k += 8) {
                __m256 v = _mm256_loadu_ps(x + k);
                vmax = _mm256_max_ps(vmax, v);
                vmin = _mm256_min_ps(vmin, v);
            }
            float hi_l[8], lo_l[8];
            _mm256_storeu_ps(hi_l, vmax);
            _mm256_storeu_ps(lo_l, vmin);
            float hi = hi_l[0], lo = lo_l[0];
            for (int j = 1; j < 8; j++) {
                hi = hi_l[j] > hi ? hi_l[j] : hi;
                lo = lo_l[j] < lo ? lo_l[j] : lo;
            }
            float s, z = 0.f;
            if (symmetric) {
                float amax = -lo > hi ? -lo : hi;
                s = qarl_round_bf16(amax / 7.5f);
            } else {
                s = qarl_round_bf16((hi - lo) / 15.f);
            }
            if (!(s > 0.f)) s = 1.f;
            if (!symmetric) {
                z = qarl_round_bf16(lo + 8.f * s);
                zeros[n * G + g] = bf16_bits(z);
            }
            scales[n * G + g] = bf16_bits(s);
            const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
            const __m256 qlo = _mm256_set1_ps(-8.f), qhi = _mm256_set1_ps(7.f);
            uint8_t* out = packed + n * (K / 2) + g * group / 2;
            float* d = deq ? deq + n * K + g * group : 0;
            for (int64_t k = 0; k < group; k += 8) {
                __m256 v = _mm256_loadu_ps(x + k);
                if (!symmetric) v = _mm256_sub_ps(v, vz);
                __m256 q = _mm256_round_ps(_mm256_div_ps(v, vs),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q = _mm256_min_ps(_mm256_max_ps(q, qlo), qhi);
                int32_t c[8];
                _mm256_storeu_si256((__m256i*)c, _mm256_cvtps_epi32(q));
                for (int j = 0; j < 4; j++)
                    out[k / 2 + j] = (uint8_t)((c[2 * j] + 8) | ((c[2 * j + 1] + 8) << 4));
                if (d) {
                    __m256 r = _mm256_mul_ps(q, vs);
                    if (!symmetric) r = _mm256_add_ps(r, vz);
                    _mm256_storeu_ps(d + k, r);
                }
            }
        }
    }
}

// panel codes [K/2][NR], scales/zeros [G][NR] fp32 -> buf [K][NR] fp32.
INLINE void dequant_u4(const uint8_t* w, const float* s, const float* z, int64_t K, int64_t group,
                       float* buf) {
    const __m256i low = _mm256_set1_epi32(15);
    const __m256 eight = _mm256_set1_ps(8.f);
    for (int64_t i = 0; i < K / 2; i++) {
        int64_t g = (2 * i) / group;
        for (int j = 0; j < 3; j++) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(w + i * NR + 8 * j)));
            __m256 q0 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), eight);
            __m256 q1 = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), eight);
            __m256 sg = _mm256_loadu_ps(s + g * NR + 8 * j);
            __m256 w0, w1;
            if (z) {
                __m256 zg = _mm256_loadu_ps(z + g * NR + 8 * j);
                w0 = _mm256_fmadd_ps(q0, sg, zg);
                w1 = _mm256_fmadd_ps(q1, sg, zg);
            } else {
                w0 = _mm256_mul_ps(q0, sg);
                w1 = _mm256_mul_ps(q1, sg);
            }
            _mm256_storeu_ps(buf + (2 * i) * NR + 8 * j, w0);
            _mm256_storeu_ps(buf + (2 * i + 1) * NR + 8 * j, w1);
        }
    }
}

// One or two rows straight from the codes (decoding at batch 1-2 is bound by dequantizing, so
// no buffer round trip): the same w values in the same fma order as dequant_u4 + tile_f32,
// hence the same bits. All 24 columns advance together (a chain waits 4 cycles per fma, so
// fewer than 3 chains in flight would idle the core); groups outermost.
// w from u as float: fma(u - 8, s, z) with zeros; fma(u, s, t) with t = -8 s without (u s - 8 s
// is (u - 8) s exactly, representable, so the one rounding keeps it: the same value as
// (u - 8) * s, one subtraction fewer)
#define DEQ_U4(u, sg, tg, zg) \
    (z ? _mm256_fmadd_ps(_mm256_sub_ps(u, eight), sg, zg) : _mm256_fmadd_ps(u, sg, tg))
INLINE void direct_u4(int mr, const float* x, int64_t ldx, const uint8_t* w, const float* s,
                      const float* z, int64_t K, int64_t group, int nc, const float* xs,
                      const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy) {
    const __m256i low = _mm256_set1_epi32(15);
    const __m256 eight = _mm256_set1_ps(8.f), minus8 = _mm256_set1_ps(-8.f);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
    for (int64_t g = 0; g < K / group; g++) {
        __m256 s0 = _mm256_loadu_ps(s + g * NR), s1 = _mm256_loadu_ps(s + g * NR + 8),
               s2 = _mm256_loadu_ps(s + g * NR + 16);
        __m256 z0 = s0, z1 = s1, z2 = s2;  // unused when symmetric
        __m256 t0 = _mm256_mul_ps(s0, minus8), t1 = _mm256_mul_ps(s1, minus8),
               t2 = _mm256_mul_ps(s2, minus8);  // unused with zeros
        if (z) {
            z0 = _mm256_loadu_ps(z + g * NR);
            z1 = _mm256_loadu_ps(z + g * NR + 8);
            z2 = _mm256_loadu_ps(z + g * NR + 16);
        }
        for (int64_t i = g * group / 2; i < (g + 1) * group / 2; i++) {
            const uint8_t* wi = w + i * NR;
            __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)wi));
            __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(wi + 8)));
            __m256i v2 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(wi + 16)));
            // k = 2i: low nibbles
            __m256 w0 = DEQ_U4(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), s0, t0, z0);
            __m256 w1 = DEQ_U4(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), s1, t1, z1);
            __m256 w2 = DEQ_U4(_mm256_cvtepi32_ps(_mm256_and_si256(v2, low)), s2, t2, z2);
            __m256 xa = _mm256_broadcast_ss(x + 2 * i);
            a0 = _mm256_fmadd_ps(xa, w0, a0);
            a1 = _mm256_fmadd_ps(xa, w1, a1);
            a2 = _mm256_fmadd_ps(xa, w2, a2);
            if (mr > 1) {
                __m256 xb = _mm256_broadcast_ss(x + ldx + 2 * i);
                b0 = _mm256_fmadd_ps(xb, w0, b0);
                b1 = _mm256_fmadd_ps(xb, w1, b1);
                b2 = _mm256_fmadd_ps(xb, w2, b2);
            }
            // k = 2i + 1: high nibbles
            w0 = DEQ_U4(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), s0, t0, z0);
            w1 = DEQ_U4(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), s1, t1, z1);
            w2 = DEQ_U4(_mm256_cvtepi32_ps(_mm256_srli_epi32(v2, 4)), s2, t2, z2);
            xa = _mm256_broadcast_ss(x + 2 * i + 1);
            a0 = _mm256_fmadd_ps(xa, w0, a0);
            a1 = _mm256_fmadd_ps(xa, w1, a1);
            a2 = _mm256_fmadd_ps(xa, w2, a2);
            if (mr > 1) {
                __m256 xb = _mm256_broadcast_ss(x + ldx + 2 * i + 1);
                b0 = _mm256_fmadd_ps(xb, w0, b0);
                b1 = _mm256_fmadd_ps(xb, w1, b1);
                b2 = _mm256_fmadd_ps(xb, w2, b2);
            }
        }
    }
    store_row(a0, a1, a2, nc, xs, bias, res, y);
    if (mr > 1) store_row(b0, b1, b2, nc, xs ? xs + 1 : 0, bias, res ? res + ldr : 0, y + ldy);
}

// fp32 -> the nearest bf16 (ties to even) as fp32, what torch's x.bfloat16().float() gives.
float qarl_round_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u |= 0x00400000u;  // NaN stays a (quiet) NaN
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
    }
    u &= 0xffff0000u;
    memcpy(&v, &u, sizeof v);
    return v;
}

void qarl_round_bf16_row(const float* x, int64_t n, float* out) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) _mm256_storeu_ps(out + k, round_bf16_ps(_mm256_loadu_ps(x + k)));
    for (; k < n; k++) out[k] = qarl_round_bf16(x[k]);
}

// The panels of x . dequant(W)^T (* xs[m]) (+ bias) (+ res) shared among the threads of the
// enclosing parallel region (see kernels.h); buf: this thread's K x NR floats, used for M > 2.
void qarl_u4_panels(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* wp,
                    const float* s, const float* z, int64_t group, int64_t N, const float* xs,
                    const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy,
                    float* buf) {
    int64_t P = panels(N), G = K / group;
#pragma omp for schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int64_t n0 = p * NR;
        int nc = N - n0 < NR ? (int)(N - n0) : NR;
        const uint8_t* wpp = wp + p * (K / 2) * NR;
        const float* sp = s + p * G * NR;
        const float* zp = z ? z + p * G * NR : 0;
        const float* b = bias ? bias + n0 : 0;
        const float* r = res ? res + n0 : 0;
        if (M == 1) {
            direct_u4(1, x, ldx, wpp, sp, zp, K, group, nc, xs, b, r, ldr, y + n0, ldy);
        } else if (M == 2) {
            direct_u4(2, x, ldx, wpp, sp, zp, K, group, nc, xs, b, r, ldr, y + n0, ldy);
        } else {
            dequant_u4(wpp, sp, zp, K, group, buf);
            panel_f32(x, M, K, ldx, buf, nc, xs, b, r, ldr, y + n0, ldy);
        }
    }
}

// y[M, N] = x[M, K] . dequant(W)^T; wp from qarl_pack_u4, s/z [P][G][NR] fp32 (z may be NULL);
// bf16: round x to bf16 first (W4A16's activations).
void qarl_linear_u4(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* wp,
                    const float* s, const float* z, int64_t group, int64_t N, int bf16, float* y,
                    int64_t ldy, int nthreads) {
    float* xr = bf16 ? (float*)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1)) : 0;
#pragma omp parallel num_threads(nthreads)
    {
        const float* xin = x;
        int64_t ldin = ldx;
        if (bf16) {
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) qarl_round_bf16_row(x + m * ldx, K, xr + m * K);
            xin = xr;
            ldin = K;
        }
        // the dequantized-panel buffer only for M > 2 (1-2 rows work from registers; a buffer
        // of K x 24 floats per call would cost an mmap for large K)
        float* buf = M > 2 ? (float*)aligned_alloc(64, (size_t)((K * NR * 4 + 63) / 64 * 64)) : 0;
        qarl_u4_panels(xin, M, K, ldin, wp, s, z, group, N, 0, 0, 0, 0, y, ldy, buf);
        free(buf);
    }
    free(xr);
}
