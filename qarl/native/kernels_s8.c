// qarl's W8A8 int8 GEMM for x86-64 with AVX2 + FMA (see README.md beside this file; the
// fp32 and int4 GEMMs are in kernels.c). Every output element is an exact int32 sum, whatever
// M is: batch-invariant by construction. Built into the same library as kernels.c by build.py.

#define _GNU_SOURCE  // syscall(): AMX tiles need the kernel's permission (qarl_s8_isa)
#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "kernels.h"
#include "simd.h"
// ---------------------------------------------------------------------------------------
// int8 x int8 -> int32 (W8A8)
//
// AVX2 has no VNNI dot product; vpmaddubsw multiplies u8 x s8 and sums pairs into int16,
// which saturates for general int8 x int8. With the sign moved from the activation onto the
// weight (vpsignb) the unsigned operand is |a| <= 128 and the weight stays in [-127, 127], so a
// pair sums to at most 2 * 128 * 127 = 32512 < 2^15: exact. vpmaddwd by ones then widens each
// 4-product sum to int32 (exact for K < 2^31 / 127^2 = 133,000). Per 32 multiply-adds that is
// two multiply instructions (vpmaddubsw + vpmaddwd) where fp32 takes four FMAs: on AVX2-only
// CPUs that issue one vector integer multiply per cycle, the fp32 FMA GEMM's peak, with a
// quarter of the weight bytes (benchmarks/quant_kernels.py --parts int8 times it next to fp32
// F.linear).

#define NR8 16  // output columns per int8 panel: 2 vectors of 8 int32
#define MR8 4   // rows per tile: 4 x 2 accumulators + 2 weights + temporaries fit 16 ymm

static int64_t panels8(int64_t n) { return (n + NR8 - 1) / NR8; }

// codes [N, K] int8 in [-127, 127] -> panels [P8][Kq][NR8][4] (Kq = ceil(K / 4)), zero padded:
// panel p holds output columns 16p..16p+15, each quad of k as 4 consecutive bytes per column.
void qarl_pack_s8(const int8_t* w, int64_t N, int64_t K, int64_t ldw, int8_t* out, int nthreads) {
    int64_t P = panels8(N), Kq = (K + 3) / 4, Kf = K / 4;  // Kf: the quads without padding
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int8_t* dst = out + p * Kq * 4 * NR8;
        for (int j = 0; j < NR8; j++) {
            int64_t n = p * NR8 + j;
            int8_t* d = dst + j * 4;
            if (n >= N) {
                for (int64_t q = 0; q < Kq; q++) memset(d + q * NR8 * 4, 0, 4);
                continue;
            }
            const int8_t* src = w + n * ldw;
            for (int64_t q = 0; q < Kf; q++) memcpy(d + q * NR8 * 4, src + 4 * q, 4);
            for (int64_t q = Kf; q < Kq; q++)  // the last quad, zero padded past K
                for (int r = 0; r < 4; r++) d[q * NR8 * 4 + r] = 4 * q + r < K ? src[4 * q + r] : 0;
        }
    }
}

// codes [N, K] int8 -> the panels qarl_pack_s8 makes of their transpose [K, N], without
// writing the transpose out: the operand of dL/dx = g W_hat on the weight's codes
// (qarl.quant.schemes_8bit.Int8Codes.grad_input), whose output columns are the weight's K
// input features and whose contraction runs over its N output channels. A whole quad of
// rows x 16 columns is a 4 x 16 byte transpose: two rounds of byte and word interleaves.
void qarl_pack_s8_t(const int8_t* w, int64_t N, int64_t K, int64_t ldw, int8_t* out, int nthreads) {
    int64_t P = panels8(K), Nq = (N + 3) / 4;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t p = 0; p < P; p++) {
        int64_t k0 = p * NR8;
        int8_t* dst = out + p * Nq * 4 * NR8;
        for (int64_t q = 0; q < Nq; q++) {
            int8_t* d = dst + q * NR8 * 4;  // d[j * 4 + r] = w[4q + r, k0 + j]
            if (k0 + NR8 <= K && 4 * q + 4 <= N) {
                const int8_t* s = w + 4 * q * ldw + k0;
                __m128i a0 = _mm_loadu_si128((const __m128i*)s);
                __m128i a1 = _mm_loadu_si128((const __m128i*)(s + ldw));
                __m128i a2 = _mm_loadu_si128((const __m128i*)(s + 2 * ldw));
                __m128i a3 = _mm_loadu_si128((const __m128i*)(s + 3 * ldw));
                __m128i t0 = _mm_unpacklo_epi8(a0, a1), t1 = _mm_unpackhi_epi8(a0, a1);
                __m128i t2 = _mm_unpacklo_epi8(a2, a3), t3 = _mm_unpackhi_epi8(a2, a3);
                _mm_storeu_si128((__m128i*)d, _mm_unpacklo_epi16(t0, t2));
                _mm_storeu_si128((__m128i*)(d + 16), _mm_unpackhi_epi16(t0, t2));
                _mm_storeu_si128((__m128i*)(d + 32), _mm_unpacklo_epi16(t1, t3));
                _mm_storeu_si128((__m128i*)(d + 48), _mm_unpackhi_epi16(t1, t3));
                continue;
            }
            for (int j = 0; j < NR8; j++)  // a panel's last columns or the last rows: zero padded
                for (int r = 0; r < 4; r++) {
                    int64_t n = 4 * q + r, k = k0 + j;
                    d[j * 4 + r] = n < N && k < K ? w[n * ldw + k] : 0;
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

// ---------------------------------------------------------------------------------------
// AMX-INT8: the panels above, multiplied in tiles.
//
// TDPBSSD multiplies a 16 x 64 int8 tile A by a 16 x 64 int8 tile B laid out as 16 quads of k
// by 16 columns (B[kq][4 n + i] = w[n, 4 kq + i]) and adds each group of 4 products to a
// 16 x 16 int32 tile C: signed x signed, no sign trick, exact. That B layout is the panel
// layout of qarl_pack_s8 (NR8 = 16 columns, 4 consecutive k per column), so a weight tile is
// 16 consecutive panel rows (1 KiB, row stride 64 bytes) and the packs serve every
// instruction set. Per 32 rows x 32 columns (two row blocks, two panels) the loop over k keeps
// four C tiles and loads two A and two B tiles per 64 k. The epilogue is the VNNI tile's:
// the exact sum converted once, * xs[row], * ws[n] (+ bias) (+ residual), vector for vector
// the same roundings, so AMX gives the same bits as AVX2 and VNNI (tested). K must be a
// multiple of 64 (every projection of the supported models); otherwise the call runs the
// AVX-512 VNNI panels, which AMX CPUs have. Rows past M in the last block of 16 are read
// from a zero-padded copy of those rows, never past the caller's buffer.
//
// Linux hands out the 8 KiB of tile registers only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM, once per process: torch's oneDNN makes the same request); where the
// request fails, or the compiler predates AMX, qarl runs the VNNI panels.

#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
#define QARL_AMX 1
#define AMX_TARGET "amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx2,fma"

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) amx_config;

// the 16 x 16 int32 sums of one tile -> y rows [mr, nc], as S8_NAME(tile) scales them
__attribute__((target(AMX_TARGET))) static void amx_epilogue(
    const int32_t* acc, int mr, int nc, const float* xs, const float* ws, const float* bias,
    const float* res, int64_t ldr, float* y, int64_t ldy) {
    const __mmask16 cols = (__mmask16)(nc >= 16 ? 0xFFFF : (1u << nc) - 1);
    const __m512 w = _mm512_loadu_ps(ws);  // scales are padded to whole panels
    const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + 16 * r)),
                                               _mm512_set1_ps(xs[r])), w);
        if (bias) v = _mm512_add_ps(v, b);
        if (res) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(cols, res + r * ldr));
        _mm512_mask_storeu_ps(y + r * ldy, cols, v);
    }
}

__attribute__((target(AMX_TARGET))) static void panels_amx(
    const int8_t* x, int64_t M, int64_t Kq, int64_t ld, const float* xs, const int8_t* wp,
    const float* ws, int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
    int64_t ldy) {
    int64_t P = panels8(N), pairs = (P + 1) / 2, KT = Kq / 16, Mfull = M / 16 * 16;
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);  // per thread: tile state is a thread's own
    int8_t* tail = 0;        // rows Mfull..M-1, zero padded to 16 rows
    if (M > Mfull) {
        tail = (int8_t*)calloc((size_t)(16 * ld), 1);
        memcpy(tail, x + Mfull * ld, (size_t)((M - Mfull) * ld));
    }
    int32_t acc[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t pp = 0; pp < pairs; pp++) {
        int64_t n0 = 2 * pp * NR8;
        int two = 2 * pp + 1 < P;  // a second panel in this pair
        const int8_t* b0 = wp + 2 * pp * Kq * 4 * NR8;
        const int8_t* b1 = b0 + Kq * 4 * NR8;
        for (int64_t m0 = 0; m0 < M; m0 += 32) {
            int second = m0 + 16 < M;  // a second block of rows
            const int8_t* a0 = m0 < Mfull ? x + m0 * ld : tail;
            const int8_t* a1 = m0 + 16 < Mfull ? x + (m0 + 16) * ld : tail;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kt = 0; kt < KT; kt++) {
                _tile_loadd(4, a0 + kt * 64, ld);
                _tile_loadd(6, b0 + kt * 1024, 64);
                _tile_dpbssd(0, 4, 6);
                if (two) {
                    _tile_loadd(7, b1 + kt * 1024, 64);
                    _tile_dpbssd(1, 4, 7);
                }
                if (second) {
                    _tile_loadd(5, a1 + kt * 64, ld);
                    _tile_dpbssd(2, 5, 6);
                    if (two) _tile_dpbssd(3, 5, 7);
                }
            }
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            _tile_stored(2, acc[2], 64);
            _tile_stored(3, acc[3], 64);
            for (int blk = 0; blk < 4; blk++) {
                int64_t r0 = m0 + (blk >> 1) * 16, c0 = n0 + (blk & 1) * NR8;
                if (r0 >= M || c0 >= N) continue;
                int mr = M - r0 < 16 ? (int)(M - r0) : 16, nc = N - c0 < NR8 ? (int)(N - c0) : NR8;
                amx_epilogue(acc[blk], mr, nc, xs + r0, ws + c0, bias ? bias + c0 : 0,
                             res ? res + r0 * ldr + c0 : 0, ldr, y + r0 * ldy + c0, ldy);
            }
        }
    }
    free(tail);
    _tile_release();
}

// Whether this CPU has AMX-INT8 tiles and Linux lets this process use them.
static int amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return 0;  // AMX-TILE, AMX-INT8
    // ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
#else
#define QARL_AMX 0
static int amx_usable(void) { return 0; }
#endif

// Which int8 arithmetic qarl_s8_panels runs: S8_AVX2, a VNNI one or AMX where the CPU has it
// (chosen at the first call from the CPU's own flags; qarl_s8_set_isa overrides, for tests).
enum { S8_AUTO = -1, S8_AVX2 = 0, S8_AVXVNNI = 1, S8_AVX512VNNI = 2, S8_AMX = 3 };
static int s8_isa = S8_AUTO;

static int s8_supported(int isa) {
    __builtin_cpu_init();
    switch (isa) {
        case S8_AVX2: return 1;
        case S8_AVXVNNI: return __builtin_cpu_supports("avxvnni");
        case S8_AVX512VNNI:
            return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
        case S8_AMX:
            return s8_supported(S8_AVX512VNNI) && amx_usable();  // K % 64 != 0 runs VNNI-512
        default: return 0;
    }
}

// The first call may come from every thread of a parallel region at once: each works the
// level out on its own (requesting the AMX permission before it can answer S8_AMX) and only
// then publishes it, so no thread runs a level another has merely begun to check.
int qarl_s8_isa(void) {
    int isa = __atomic_load_n(&s8_isa, __ATOMIC_ACQUIRE);
    if (isa == S8_AUTO) {
        isa = S8_AMX;
        while (!s8_supported(isa)) isa--;
        __atomic_store_n(&s8_isa, isa, __ATOMIC_RELEASE);
    }
    return isa;
}

// Force the int8 arithmetic (S8_AVX2 always runs; a higher level only where the CPU has it;
// AVX-VNNI asked on a CPU with AVX512-VNNI only runs that, the same instruction on the same
// 256-bit vectors); returns the level now in use.
int qarl_s8_set_isa(int isa) {
    __atomic_store_n(&s8_isa, S8_AUTO, __ATOMIC_RELEASE);
    int best = qarl_s8_isa();
    if (isa < S8_AVX2 || isa > best) {
        isa = best;
    } else if (isa == S8_AVXVNNI && !s8_supported(S8_AVXVNNI)) {
        isa = S8_AVX512VNNI;
    }
    __atomic_store_n(&s8_isa, isa, __ATOMIC_RELEASE);
    return isa;
}

void qarl_s8_panels(const int8_t* x, int64_t M, int64_t Kq, int64_t ld, const float* xs,
                    const int8_t* wp, const float* ws, int64_t N, const float* bias,
                    const float* res, int64_t ldr, float* y, int64_t ldy) {
    switch (qarl_s8_isa()) {
#if QARL_AMX
        case S8_AMX:
            if (Kq % 16 == 0) {
                panels_amx(x, M, Kq, ld, xs, wp, ws, N, bias, res, ldr, y, ldy);
                break;
            }
            // fall through: K not a multiple of 64
#endif
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
        // 8 int32 in [-127, 127] -> 8 int8: the saturating packs change no value
        __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
        _mm_storel_epi64((__m128i*)(q + k), _mm_packs_epi16(c16, c16));
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

// o[k] = bf16((float)q[k] * s) (bits): an int8 row dequantized as torch's q * s (one rounded
// fp32 product), then rounded to the nearest bf16, ties to even, as .bfloat16().
INLINE void dequant_row_bf16(const int8_t* q, float s, int64_t K, uint16_t* o) {
    const __m256 vs = _mm256_set1_ps(s);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(q + k)));
        __m256 v = round_bf16_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(c), vs));
        __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(
            _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(v), 16),
                                _mm256_setzero_si256()), 0x08));
        _mm_storeu_si128((__m128i*)(o + k), h);
    }
    for (; k < K; k++) {
        float v = qarl_round_bf16((float)q[k] * s);
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        o[k] = (uint16_t)(u >> 16);
    }
}

// A W8A8 weight, codes [N, K] and per-channel scales [N], dequantized into bf16 bits [N, K]:
// `(codes * scales[:, None]).bfloat16()` bit for bit, in one pass (a bf16 gradient pass's
// W_hat, once per weight version).
void qarl_dequant_s8_bf16(const int8_t* codes, const float* scales, int64_t N, int64_t K,
                          uint16_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
    for (int64_t n = 0; n < N; n++) dequant_row_bf16(codes + n * K, scales[n], K, out + n * K);
}

// out = (float)codes[n, k] * scales[n]: W8A8's weight dequantized in fp32, one rounded product
// per entry as `torch.mul(codes, scales[:, None])` computes it, in one pass (torch's type
// promotion converts the codes in a pass of their own first). A learner layer's backward
// dequantizes its weight so, once per micro-batch.
void qarl_dequant_s8_f32(const int8_t* codes, const float* scales, int64_t N, int64_t K,
                         float* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K > 32768)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* c = codes + n * K;
        float* o = out + n * K;
        const float s = scales[n];
        for (int64_t k = 0; k < K; k++) o[k] = (float)c[k] * s;
    }
}

// x_hat = (float)q * s for each row of x [M, K] fp32 (row stride ldx), (q, s) =
// numerics.int8_rows of the row: what `q.float() * s[:, None]` gives, bit for bit, in one pass
// per row without the codes between. out: [M, K] fp32 (row stride ldo). W8A8's activation
// quantize-dequantize in an fp32 gradient pass's backward.
void qarl_qdq_s8_rows_f32(const float* x, int64_t M, int64_t K, int64_t ldx, float* out,
                          int64_t ldo, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (M * K > 32768)
    {
        int8_t* q = (int8_t*)malloc((size_t)(K > 0 ? K : 1));
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float sc;
            qarl_quantize_row_s8(x + m * ldx, K, q, &sc);
            float* o = out + m * ldo;
            for (int64_t k = 0; k < K; k++) o[k] = (float)q[k] * sc;
        }
        free(q);
    }
}

// x_hat = bf16((float)q * s) for each row of x [M, K] (fp32, or bf16 bits when x_bf16; row
// stride ldx), (q, s) = numerics.int8_rows of the row (of its fp32 values): what
// `(q.float() * s[:, None]).bfloat16()` gives, bit for bit, in one pass per row without the
// fp32 tensor between. out: [M, K] bf16 bits (row stride ldo). W8A8's activation
// quantize-dequantize in a bf16 gradient pass.
void qarl_qdq_s8_rows_bf16(const void* x, int x_bf16, int64_t M, int64_t K, int64_t ldx,
                           uint16_t* out, int64_t ldo, int nthreads) {
#pragma omp parallel num_threads(nthreads) if (M * K > 32768)
    {
        int8_t* q = (int8_t*)malloc((size_t)(K > 0 ? K : 1));
        float* row = x_bf16 ? (float*)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1)) : 0;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            const float* xr;
            if (x_bf16) {
                const uint16_t* b = (const uint16_t*)x + m * ldx;
                for (int64_t k = 0; k < K; k++) {
                    uint32_t u = (uint32_t)b[k] << 16;
                    memcpy(row + k, &u, sizeof u);
                }
                xr = row;
            } else {
                xr = (const float*)x + m * ldx;
            }
            float sc;
            qarl_quantize_row_s8(xr, K, q, &sc);
            dequant_row_bf16(q, sc, K, out + m * ldo);
        }
        free(row);
        free(q);
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
#pragma omp parallel num_threads(nthreads) if (M * K * N > 1 << 16)
    {
        // rows quantized in parallel from a few rows on (a prefill's or a learner's hundreds)
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) qarl_quantize_row_s8(x + m * ldx, K, xq + m * ld, xs + m);
        qarl_s8_panels(xq, M, Kq, ld, xs, wp, ws, N, 0, 0, 0, y, ldy);
    }
    free(xs);
    free(xq);
}

// The same GEMM on activation codes already made (numerics.int8_rows of x: codes [M, K] with
// row stride ldq, scales [M]): for a learner that keeps the codes for its backward.
void qarl_linear_s8_codes(const int8_t* xq, int64_t M, int64_t K, int64_t ldq, const float* xs,
                          const int8_t* wp, const float* ws, int64_t N, float* y, int64_t ldy,
                          int nthreads) {
    int64_t Kq = (K + 3) / 4, ld = Kq * 4;
    int8_t* padded = 0;  // rows the panels read in whole quads of k
    if (ld != ldq) {
        padded = (int8_t*)calloc((size_t)(M * ld), 1);
        for (int64_t m = 0; m < M; m++) memcpy(padded + m * ld, xq + m * ldq, (size_t)K);
    }
#pragma omp parallel num_threads(nthreads) if (M * K * N > 1 << 16)
    qarl_s8_panels(padded ? padded : xq, M, Kq, ld, xs, wp, ws, N, 0, 0, 0, y, ldy);
    free(padded);
}
