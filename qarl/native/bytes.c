// Passes over raw bytes for the weight sync (see README.md beside this file): the CRC-32 of a
// buffer, the same value as zlib's crc32 (the digests of the contract check, qarl.quant.digests),
// and the number of bytes at which two buffers differ (the codes a push changed,
// qarl.train.sync.code_changes). Built into the same library as kernels.c by build.py.

#include <cpuid.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

// ---------------------------------------------------------------------------------------
// CRC-32 (zlib's: reflected polynomial 0xEDB88320, the state inverted before and after).
//
// Buffers of 64 bytes or more are folded with carry-less multiplies (PCLMULQDQ): four 128-bit
// lanes, each multiplied by x^(512+64) and x^512 mod P per 64 bytes and added to the next
// bytes, then folded into one lane, reduced to 64 and 32 bits and by Barrett reduction to the
// remainder (Intel's "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", with the
// constants of the reflected zlib polynomial). The bytes past the last whole 16 go through the
// table (slicing by 8), as a CPU without PCLMULQDQ does for the whole buffer. Every path
// computes the same remainder, so the value is zlib's whatever the length (tested).

static uint32_t crc_table[8][256];
static int crc_clmul;  // PCLMULQDQ and SSE4.1 here

static int has_pclmul(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_PCLMUL) && (c & bit_SSE4_1);
}

__attribute__((constructor)) static void crc_tables(void) {
    crc_clmul = has_pclmul();
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            crc_table[k][n] = (crc_table[k - 1][n] >> 8) ^ crc_table[0][crc_table[k - 1][n] & 0xff];
}

// the raw state (not inverted) c after n more bytes, by the tables
static uint32_t crc_bytes(uint32_t c, const uint8_t* p, int64_t n) {
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, sizeof v);  // little-endian: the first byte is the lowest
        v ^= c;
        c = crc_table[7][v & 0xff] ^ crc_table[6][(v >> 8) & 0xff] ^
            crc_table[5][(v >> 16) & 0xff] ^ crc_table[4][(v >> 24) & 0xff] ^
            crc_table[3][(v >> 32) & 0xff] ^ crc_table[2][(v >> 40) & 0xff] ^
            crc_table[1][(v >> 48) & 0xff] ^ crc_table[0][v >> 56];
    }
    for (; n > 0; p++, n--) c = crc_table[0][(c ^ *p) & 0xff] ^ (c >> 8);
    return c;
}

#define CLMUL_TARGET "pclmul,sse4.1"

__attribute__((target(CLMUL_TARGET))) static inline __m128i fold16(__m128i x, __m128i k,
                                                                  __m128i next) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)), next);
}

// the raw state c after n bytes, n >= 64 and a multiple of 16
__attribute__((target(CLMUL_TARGET))) static uint32_t crc_fold(uint32_t c, const uint8_t* p,
                                                              int64_t n) {
    // x^k mod P for the folds across 512 and 128 bits, and for the 64 -> 32 bit fold
    const __m128i k12 = _mm_set_epi64x(0x1c6e41596, 0x154442bd4);
    const __m128i k34 = _mm_set_epi64x(0x0ccaa009e, 0x1751997d0);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124);
    const __m128i mu_p = _mm_set_epi64x(0x1f7011641, 0x1db710641);  // Barrett's mu, P
    const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
    __m128i x0 = _mm_loadu_si128((const __m128i*)p), x1 = _mm_loadu_si128((const __m128i*)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i*)(p + 32)), x3 = _mm_loadu_si128((const __m128i*)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)c));
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) {
        x0 = fold16(x0, k12, _mm_loadu_si128((const __m128i*)p));
        x1 = fold16(x1, k12, _mm_loadu_si128((const __m128i*)(p + 16)));
        x2 = fold16(x2, k12, _mm_loadu_si128((const __m128i*)(p + 32)));
        x3 = fold16(x3, k12, _mm_loadu_si128((const __m128i*)(p + 48)));
    }
    x0 = fold16(fold16(fold16(x0, k34, x1), k34, x2), k34, x3);
    for (; n >= 16; p += 16, n -= 16) x0 = fold16(x0, k34, _mm_loadu_si128((const __m128i*)p));
    // 128 -> 64 bits (with 32 zero bits appended), 64 -> 32, then Barrett's reduction
    x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(x0, k34, 0x10));
    x0 = _mm_xor_si128(_mm_srli_si128(x0, 4),
                       _mm_clmulepi64_si128(_mm_and_si128(x0, low32), k5, 0x00));
    __m128i t = _mm_and_si128(_mm_clmulepi64_si128(_mm_and_si128(x0, low32), mu_p, 0x10), low32);
    x0 = _mm_xor_si128(x0, _mm_clmulepi64_si128(t, mu_p, 0x00));
    return (uint32_t)_mm_extract_epi32(x0, 1);
}

// zlib.crc32(bytes, crc): the CRC-32 of n bytes at p, continuing from crc (0 to start)
uint32_t qarl_crc32(const uint8_t* p, int64_t n, uint32_t crc) {
    uint32_t c = ~crc;
    if (crc_clmul && n >= 64) {
        int64_t whole = n & ~(int64_t)15;
        c = crc_fold(c, p, whole);
        p += whole;
        n -= whole;
    }
    return ~crc_bytes(c, p, n);
}

// ---------------------------------------------------------------------------------------
// The number of positions i < n at which a[i] != b[i]: 32 bytes compared per instruction, the
// equal ones counted from the compare's mask.

__attribute__((target("avx2,popcnt"))) int64_t qarl_count_changed_bytes(
    const uint8_t* a, const uint8_t* b, int64_t n, int nthreads) {
    int64_t blocks = n / 32, changed = 0;
#pragma omp parallel for num_threads(nthreads) reduction(+ : changed) schedule(static) \
    if (n >= (1 << 20))
    for (int64_t i = 0; i < blocks; i++) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(a + 32 * i));
        __m256i y = _mm256_loadu_si256((const __m256i*)(b + 32 * i));
        changed += 32 - _mm_popcnt_u32((uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, y)));
    }
    for (int64_t i = 32 * blocks; i < n; i++) changed += a[i] != b[i];
    return changed;
}
