// The small per-token operations of a decoder block, for x86-64 with AVX2 + FMA (see
// README.md beside this file). Each is little arithmetic on one row per sequence, where
// PyTorch spends more on dispatch (F.rms_norm alone dispatches several ops) than on the work;
// a decode step runs them several times per layer (benchmarks/quant_kernels.py --parts blocks).
// Built into the same library as kernels.c by build.py.
// Every output row depends on its own input row only (batch-invariant by construction).

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

// out [M, N] = RMSNorm of each row of x [M, N] (row strides ldx, ldo) with weight w [N].
void qarl_rms_norm(const float* x, int64_t M, int64_t N, int64_t ldx, const float* w, float eps,
                   float* out, int64_t ldo, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * N > 32768)
    for (int64_t m = 0; m < M; m++) rms_norm_row(x + m * ldx, N, w, eps, out + m * ldo);
}

// o[F] = silu(g) * u for one row, silu(g) = g / (1 + exp(-g)) as PyTorch computes it (its own
// exp: equal to ~1 ulp).
INLINE void silu_mul_row(const float* g, const float* u, int64_t F, float* o) {
    const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) {
        __m256 vg = _mm256_loadu_ps(g + i);
        __m256 den = _mm256_add_ps(one, exp_ps(_mm256_sub_ps(zero, vg)));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(vg, den), _mm256_loadu_ps(u + i)));
    }
    for (; i < F; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

// out [M, F] = silu(gate) * up for gate_up [M, 2F] (gate columns first), SwiGLU's product.
void qarl_silu_mul(const float* gate_up, int64_t M, int64_t F, float* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * F > 32768)
    for (int64_t m = 0; m < M; m++) silu_mul_row(gate_up + m * 2 * F, gate_up + m * 2 * F + F, F, out + m * F);
}

// ---------------------------------------------------------------------------------------
// A whole decoder block for one new token per sequence, in one OpenMP region.
//
// At batch 1 a block's arithmetic is small, and eight separate calls (two norms, four GEMMs,
// the attention step, the SwiGLU product) would each pay a Python wrapper, a ctypes call and
// the start of a parallel region, and the thread that finishes first would wait at each end
// (benchmarks/quant_kernels.py --parts blocks times the one call). Here the threads enter
// once and meet at barriers.
// Every step is the very function the separate calls use, on the same inputs, so the result
// equals the step-by-step fused block bit for bit.

enum { GEMM_F32 = 0, GEMM_S8 = 1, GEMM_U4_BF16 = 2, GEMM_U4_S8 = 3 };

// One projection: its kernel, packed weight and bias (DecodeBlock in decode.py builds these;
// `kind` is decode.py's GemmKind, which the quantization scheme names).
typedef struct {
    int32_t kind;   // GEMM_*: fp32 panels; W8A8 (rows quantized per token); int4 groups with
                    // bf16-rounded rows (W4A16); int4 groups with int8 rows (W4A8)
    int32_t group;  // int4 group size
    int64_t n, k;   // output and input features
    const void* w;  // packed weight (qarl_pack_f32 / qarl_pack_s8 / qarl_pack_u4)
    const float* s; // W8A8: per-channel scales padded to whole panels; int4: group scales
    const float* z; // int4 zeros, or NULL (symmetric)
    const float* bias;  // [n] or NULL
} qarl_gemm;

typedef struct {
    qarl_gemm qkv, o, gate_up, down;  // q/k/v rows stacked; gate/up rows stacked
    const float *ln1, *ln2;           // input / post-attention RMSNorm weights [d]
    const float *qn, *kn;             // Qwen3 per-head q / k RMSNorm weights [D], or NULL
    float eps1, eps2, qk_eps;
    float scale;                      // attention scale, 1 / sqrt(D)
    int64_t H, Hkv, D, d, ffn;
} qarl_block;

// Per-call scratch shared by the threads: the rows a quantized GEMM reads.
typedef struct {
    int8_t* codes;  // [M, Kmax rounded up to 4] int8 rows (zero padded)
    float* scales;  // [M]
    float* rows;    // [M, Kmax] float rows (bf16-rounded, or int8 codes as floats)
} gemm_scratch;

// y [M, n] (row stride ldy) = g(x [M, k] contiguous) (+ bias) (+ res, may alias y). Called by
// every thread of the region; the row preparation is one `omp for` over rows (its barrier
// makes the rows visible), the product another.
static void block_gemm(const qarl_gemm* g, const float* x, int64_t M, float* y, int64_t ldy,
                       const float* res, gemm_scratch* t, float* buf) {
    int64_t K = g->k, ld = (K + 3) / 4 * 4;
    switch (g->kind) {
        case GEMM_F32:
            qarl_f32_panels(x, M, K, K, (const float*)g->w, g->n, g->bias, res, ldy, y, ldy);
            return;
        case GEMM_S8:
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                qarl_quantize_row_s8(x + m * K, K, t->codes + m * ld, t->scales + m);
                memset(t->codes + m * ld + K, 0, (size_t)(ld - K));
            }
            qarl_s8_panels(t->codes, M, ld / 4, ld, t->scales, (const int8_t*)g->w, g->s, g->n,
                           g->bias, res, ldy, y, ldy);
            return;
        case GEMM_U4_BF16:
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) qarl_round_bf16_row(x + m * K, K, t->rows + m * K);
            qarl_u4_panels(t->rows, M, K, K, (const uint8_t*)g->w, g->s, g->z, g->group, g->n, 0,
                           g->bias, res, ldy, y, ldy, buf);
            return;
        default:  // GEMM_U4_S8: (sum_k q_x w) * s_x, the codes exact in fp32
#pragma omp for schedule(static)
            for (int64_t m = 0; m < M; m++) {
                qarl_quantize_row_s8(x + m * K, K, t->codes + m * ld, t->scales + m);
                for (int64_t k = 0; k < K; k++) t->rows[m * K + k] = (float)t->codes[m * ld + k];
            }
            qarl_u4_panels(t->rows, M, K, K, (const uint8_t*)g->w, g->s, g->z, g->group, g->n,
                           t->scales, g->bias, res, ldy, y, ldy, buf);
            return;
    }
}

static int is_u4(const qarl_gemm* g) { return g->kind == GEMM_U4_BF16 || g->kind == GEMM_U4_S8; }

// x [B, d] (in place) = the block applied to one token per sequence, as the engine's
// step-by-step fused block (qarl.rollout) computes it. Cache, RoPE and mask arguments as
// qarl_decode_attention's.
void qarl_decode_block(const qarl_block* blk, float* x, int64_t B, const float* cos,
                       const float* sin, int64_t cs_sb, float* kc, float* vc, int64_t c_sb,
                       int64_t c_sh, int64_t c_ss, int64_t slot, const uint8_t* mask,
                       int64_t mask_sb, int nthreads) {
    int64_t H = blk->H, Hkv = blk->Hkv, D = blk->D, d = blk->d, F = blk->ffn;
    int64_t W = (H + 2 * Hkv) * D, S8 = (slot + 1 + 7) / 8 * 8;
    int64_t kmax = d > H * D ? d : H * D;
    kmax = kmax > F ? kmax : F;
    int64_t kq = (kmax + 3) / 4 * 4;
    // shared scratch, one allocation: h [B, d], qkv [B, W], q [B, H D], attention [B, H D],
    // gate_up [B, 2F], hidden [B, F], quantized-GEMM rows
    size_t floats = (size_t)(B * (d + W + 2 * H * D + 3 * F + 1 + kmax));
    float* h = (float*)malloc(sizeof(float) * floats + (size_t)(B * kq));
    float *qkv = h + B * d, *q = qkv + B * W, *att = q + B * H * D, *gu = att + B * H * D;
    float* hid = gu + B * 2 * F;
    gemm_scratch t = {(int8_t*)(h + floats), hid + B * F, hid + B * F + B};
    int u4_buf = B > 2 && (is_u4(&blk->qkv) || is_u4(&blk->o) || is_u4(&blk->gate_up) || is_u4(&blk->down));
#pragma omp parallel num_threads(nthreads)
    {
        float* p = (float*)malloc(sizeof(float) * (size_t)(S8 > D ? S8 : D));
        float* buf = u4_buf ? (float*)aligned_alloc(64, (size_t)((kmax * 24 * 4 + 63) / 64 * 64)) : 0;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < B; m++) rms_norm_row(x + m * d, d, blk->ln1, blk->eps1, h + m * d);
        block_gemm(&blk->qkv, h, B, qkv, W, 0, &t, buf);
        qarl_attention_step(qkv, B, H, Hkv, D, blk->qn, blk->kn, blk->qk_eps, cos, sin, cs_sb,
                            kc, vc, c_sb, c_sh, c_ss, slot, mask, mask_sb, blk->scale,
                            q, att, p);
        block_gemm(&blk->o, att, B, x, d, x, &t, buf);  // x + o_proj(attention)
#pragma omp for schedule(static)
        for (int64_t m = 0; m < B; m++) rms_norm_row(x + m * d, d, blk->ln2, blk->eps2, h + m * d);
        block_gemm(&blk->gate_up, h, B, gu, 2 * F, 0, &t, buf);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < B; m++) silu_mul_row(gu + m * 2 * F, gu + m * 2 * F + F, F, hid + m * F);
        block_gemm(&blk->down, hid, B, x, d, x, &t, buf);  // x + down(silu(gate) * up)
        free(buf);
        free(p);
    }
    free(h);
}

// ---------------------------------------------------------------------------------------
// Sampling one token per row from softmax(logits / T), by inverse CDF.
//
// Gumbel-max (argmax of z - log E) needs one exponential draw per vocabulary entry, batch x
// vocabulary draws per step from PyTorch's CPU generator. The inverse CDF needs one uniform
// per row: token = the first i whose cumulative probability exceeds u * total. Per row:
// s = z / T (fp32 division, as PyTorch's logits / T), p = exp(s - max s) (exactly 0 at -inf:
// truncated tokens are never drawn), block sums of 8 in fp64 and their running sum, then the
// scan repeats exactly those sums, so the total it compares against is the very number it
// accumulates.

#define SAMPLE_BLOCK 8

// tokens[b] for logits rows [B, V] (row stride ld), u[b] in [0, 1) from the caller's
// generator; p: scratch [B, V rounded up to 8] floats; blocks: [B, V / 8 + 1] doubles.
void qarl_sample_rows(const float* logits, int64_t B, int64_t V, int64_t ld, float temperature,
                      const double* u, float* p, double* blocks, int64_t* tokens, int nthreads) {
    int64_t V8 = (V + 7) / 8 * 8, nb = V8 / SAMPLE_BLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (B > 1)
    for (int64_t b = 0; b < B; b++) {
        const float* z = logits + b * ld;
        float* pb = p + b * V8;
        double* sums = blocks + b * (nb + 1);
        float best = -INFINITY;
        for (int64_t i = 0; i < V; i++) {
            float s = z[i] / temperature;
            pb[i] = s;
            best = s > best ? s : best;
        }
        for (int64_t i = V; i < V8; i++) pb[i] = -INFINITY;
        const __m256 vbest = _mm256_set1_ps(best), ninf = _mm256_set1_ps(-INFINITY);
        double total = 0.0;
        for (int64_t k = 0; k < nb; k++) {
            __m256 s = _mm256_loadu_ps(pb + k * SAMPLE_BLOCK);
            __m256 keep = _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ);
            __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(s, vbest)), keep);
            _mm256_storeu_ps(pb + k * SAMPLE_BLOCK, e);
            double block = 0.0;
            for (int j = 0; j < SAMPLE_BLOCK; j++) block += (double)pb[k * SAMPLE_BLOCK + j];
            sums[k] = block;
            total += block;
        }
        double target = u[b] * total, running = 0.0;
        int64_t token = -1;
        for (int64_t k = 0; k < nb && token < 0; k++) {
            if (running + sums[k] > target) {  // the token is in block k
                double inside = running;
                int64_t last = -1;
                for (int j = 0; j < SAMPLE_BLOCK; j++) {
                    int64_t i = k * SAMPLE_BLOCK + j;
                    if (pb[i] > 0.f) last = i;
                    inside += (double)pb[i];
                    if (inside > target && pb[i] > 0.f) { token = i; break; }
                }
                if (token < 0) token = last;  // a rounding tie at the block's end
            }
            running += sums[k];
        }
        if (token < 0) {  // u * total rounded up to total: the last token with mass
            for (int64_t i = V - 1; i >= 0 && token < 0; i--)
                if (pb[i] > 0.f) token = i;
        }
        tokens[b] = token < 0 ? 0 : token;
    }
}
