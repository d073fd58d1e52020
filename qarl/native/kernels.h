// Entry points shared between qarl's C files (see README.md beside this file).
//
// The *_panels functions split one product's panels among the threads of the ENCLOSING
// OpenMP parallel region (an orphaned `omp for`, with its barrier at the end), so that
// decode.c can run a whole decoder block in one region; outside a region they run on the
// calling thread. Epilogue per output element, in this order: * xs[row] (when xs is given),
// + bias[n], + res[row, n]. y may alias res (each element is read, then written, once).
#pragma once

#include <stdint.h>

void qarl_f32_panels(const float* x, int64_t M, int64_t K, int64_t ldx, const float* wp,
                     int64_t N, const float* bias, const float* res, int64_t ldr, float* y,
                     int64_t ldy);

// x: int8 rows padded with zeros to ld = Kq * 4; y = (acc * xs[m]) * ws[n] (+ bias) (+ res)
void qarl_s8_panels(const int8_t* x, int64_t M, int64_t Kq, int64_t ld, const float* xs,
                    const int8_t* wp, const float* ws, int64_t N, const float* bias,
                    const float* res, int64_t ldr, float* y, int64_t ldy);

// buf: the calling thread's K x 24 floats (M > 2 only)
void qarl_u4_panels(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* wp,
                    const float* s, const float* z, int64_t group, int64_t N, const float* xs,
                    const float* bias, const float* res, int64_t ldr, float* y, int64_t ldy,
                    float* buf);

// numerics.int8_rows of one row, bit for bit
void qarl_quantize_row_s8(const float* x, int64_t K, int8_t* q, float* scale);

// x.bfloat16().float() of one value, bit for bit; of a row of n values into out
float qarl_round_bf16(float v);
void qarl_round_bf16_row(const float* x, int64_t n, float* out);

// attention.c: one decode step's q/k norm, RoPE, cache write and attention (qarl_decode_attention
// without its parallel region); p: the calling thread's max(S rounded up to 8, D) floats
void qarl_attention_step(const float* qkv, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                         const float* qn_w, const float* kn_w, float eps, const float* cos,
                         const float* sin, int64_t cs_sb, float* kc, float* vc, int64_t c_sb,
                         int64_t c_sh, int64_t c_ss, int64_t slot, const uint8_t* mask,
                         int64_t mask_sb, float scale, float* q_buf, float* out, float* p);
