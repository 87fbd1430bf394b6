/* featbake.kernels: a batch's reads and int8/fp8 dequantising, each in one call outside the GIL.
 *
 * Optional: setup.py builds it where a C compiler is present, and featbake falls back to its
 * pure-Python path (numpy/torch, bit-identical results, tested against this) where it is not.
 *
 * dequant(src, row_stride, rows, d, dst, scheme, out) -> (low, high)
 *     Packed rows (d codes then a little-endian float32 scale, every row_stride bytes from src)
 *     into `rows * d` contiguous values of `out` at dst. The value is float32(code) * scale,
 *     computed in float32 and rounded once to the served dtype: the same bits as
 *     torch.mul(codes, scales, out=...) (fp8 codes decoded exactly, as featbake.quantize does).
 *     low, high: the smallest non-zero and the largest finite row scale (inf, 0.0: none),
 *     which tell whether the served dtype holds every value (featbake.quantize.ScaleSpan).
 *     A row whose scale is not finite (NaN or +-inf: a damaged shard; quantize never writes
 *     one) is written as the served dtype's quiet NaN in every value, on every loop, and
 *     counted: dequant returns (low, high, damaged rows).
 *
 * crc32c(crc, address, nbytes, crc_fn) -> the CRC-32C of nbytes at address extending crc: with
 *     AVX-512 and VPCLMULQDQ (and set_width(2)) by carry-less multiplication, ~3x crc_fn (the
 *     address of google_crc32c's crc32c_extend, used elsewhere), which read_rows' checks use too.
 *
 * read_rows(spans, crc_fn, scheme, out, d, threads=1)
 *     Each span (fd, offset, nbytes, dest, tail, tail_bytes, head, want) is read with pread;
 *     when want >= 0 its bytes' CRC-32C extending `head` (computed by crc_fn, the address of
 *     google_crc32c's crc32c_extend) must equal want; the padding after it, tail_bytes at tail,
 *     is zeroed. With scheme >= 0 each span is packed rows of width d + 4: read into a scratch
 *     buffer (cache-sized: the bytes are read once from the page cache and once from cache) and
 *     dequantised into dest. Returns (failure, low, high): failure None, or (index, kind, errno)
 *     for the first span that failed (kind 1 a short read, 2 a checksum mismatch, 3 a failed
 *     read with errno, 4 a row scale that is not finite; the spans after it in its run are
 *     not read); low, high as dequant's,
 *     over the rows dequantised. With threads > 1 the spans are cut into that many contiguous
 *     runs (8 at most), the first ones read on threads kept from call to call (or started here
 *     when another call uses them), the last on the caller's: still one release of the GIL
 *     for the whole batch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define FB_X86 1
#else
#define FB_X86 0
#endif

enum { SCHEME_INT8 = 0, SCHEME_FP8 = 1 };
enum { MAX_THREADS = 8 }; /* read_rows' threads at most */
enum { OUT_F32 = 0, OUT_F16 = 1, OUT_BF16 = 2 };

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Whether a row scale is finite (NaN and +-inf are a damaged row). */
static inline int finite_scale(float s) {
    return (f32_bits(s) & UINT32_C(0x7F800000)) != UINT32_C(0x7F800000);
}

/* A damaged row: every value the served dtype's quiet NaN (what torch.full(..., nan) holds),
 * the same bits whatever the loop or the NaN's payload. */
static void nan_row(void *dst, size_t d, int out) {
    for (size_t j = 0; j < d; j++) {
        if (out == 0)
            ((uint32_t *)dst)[j] = UINT32_C(0x7FC00000);
        else
            ((uint16_t *)dst)[j] = out == 1 ? UINT16_C(0x7E00) : UINT16_C(0x7FC0);
    }
}

/* float32 -> IEEE half, round to nearest even (c10's fp16_ieee_from_fp32_value). */
static inline uint16_t f16_of(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (__builtin_fabsf(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & UINT32_C(0x80000000);
    uint32_t bias = shl1_w & UINT32_C(0xFF000000);
    if (bias < UINT32_C(0x71000000)) bias = UINT32_C(0x71000000);
    base = bits_f32((bias >> 1) + UINT32_C(0x07800000)) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & UINT32_C(0x00007C00);
    const uint32_t mantissa_bits = bits & UINT32_C(0x00000FFF);
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | (shl1_w > UINT32_C(0xFF000000) ? UINT16_C(0x7E00) : nonsign));
}

/* float32 -> bfloat16, round to nearest even (c10's round_to_nearest_even). */
static inline uint16_t bf16_of(float f) {
    if (f != f) return UINT16_C(0x7FC0);
    const uint32_t u = f32_bits(f);
    return (uint16_t)((u + UINT32_C(0x7FFF) + ((u >> 16) & 1)) >> 16);
}

/* An e4m3fn code as float32, exactly: its magnitude is the integer N = (e ? 8 + m << e - 1 : m)
 * times 2**-9, so no step passes through a float32 subnormal (which costs a microcode assist on
 * x86: featbake.quantize's bit move does). The two NaN codes, never written, read as +-480 as
 * there. */
static inline float fp8_value(uint8_t c) {
    const uint32_t e = (c >> 3) & 15, m = c & 7, nz = e ? 1 : 0;
    const float v = (float)((m | nz << 3) << (e - nz)) * 0x1.0p-9f;
    return bits_f32(f32_bits(v) | (uint32_t)(c & 0x80) << 24);
}

static inline float code_value(const uint8_t *src, size_t j, int scheme) {
    return scheme == SCHEME_INT8 ? (float)(int8_t)src[j] : fp8_value(src[j]);
}

/* Inlined into the SIMD loops for their tails: called from them, a function compiled without
 * AVX ran with the vector registers' upper halves dirty and cost ~200 cycles a row. */
static inline __attribute__((always_inline)) void row_scalar(const uint8_t *src, float s,
                                                             void *dst, size_t from, size_t d,
                                                             int scheme, int out) {
    for (size_t j = from; j < d; j++) {
        const float v = code_value(src, j, scheme) * s;
        if (out == OUT_F32)
            ((float *)dst)[j] = v;
        else if (out == OUT_F16)
            ((uint16_t *)dst)[j] = f16_of(v);
        else
            ((uint16_t *)dst)[j] = bf16_of(v);
    }
}

#if FB_X86
#define FB_AVX2 __attribute__((target("avx2,f16c")))

/* Eight e4m3fn codes (zero-extended to 16 bits) as float32, exactly: the code's bits moved into
 * an IEEE half (4 exponent bits in its 5, bias 15 against 7) read by the F16C conversion, which
 * takes subnormal halves without a microcode assist, then times 2**8 (exact). */
FB_AVX2 static inline __m256 fp8_halves(__m128i c) {
    const __m128i mag = _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7F)), 7);
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(c, _mm_set1_epi16(0x80)), 8);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(mag, sign)), _mm256_set1_ps(256.0f));
}

/* Eight codes at src as float32 values (exact). */
FB_AVX2 static inline __m256 codes8(const uint8_t *src, int scheme) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)src);
    if (scheme == SCHEME_INT8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    return fp8_halves(_mm_cvtepu8_epi16(b));
}

/* Eight float32 values as bfloat16, round to nearest even (no NaN reaches here). */
FB_AVX2 static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi);
}

FB_AVX2 static inline __attribute__((always_inline)) void row_avx2_of(const uint8_t *src, float s, void *dst, size_t d, int scheme,
                             int out) {
    const __m256 vs = _mm256_set1_ps(s);
    size_t j = 0;
    for (; j + 8 <= d; j += 8) {
        const __m256 p = _mm256_mul_ps(codes8(src + j, scheme), vs);
        if (out == OUT_F32)
            _mm256_storeu_ps((float *)dst + j, p);
        else if (out == OUT_F16)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + j),
                             _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
        else
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + j), bf16x8(p));
    }
    row_scalar(src, s, dst, j, d, scheme, out);
}

/* Packed rows into `out` values, each row by ROW (row_avx2_of, row_avx512_of) with its scheme and
 * dtype constant, so each of the six loops compiles without branches: defines NAME_of (the rows
 * loop of one scheme and dtype) and NAME (the dispatch to it), both compiled for ATTR's ISA. */
#define FB_ROWS(NAME, ROW, ATTR)                                                                 \
    ATTR static inline __attribute__((always_inline)) void NAME##_of(                          \
        const uint8_t *src, size_t row_stride, size_t rows, size_t d, uint8_t *dst, int scheme, \
        int out) {                                                                             \
        const size_t out_row = d * (out == OUT_F32 ? 4 : 2);                                   \
        for (size_t r = 0; r < rows; r++) {                                                    \
            float s;                                                                           \
            memcpy(&s, src + r * row_stride + d, 4);                                           \
            if (finite_scale(s))                                                               \
                ROW(src + r * row_stride, s, dst + r * out_row, d, scheme, out);               \
            else                                                                               \
                nan_row(dst + r * out_row, d, out);                                            \
        }                                                                                      \
    }                                                                                          \
    ATTR static void NAME(const uint8_t *src, size_t row_stride, size_t rows, size_t d,        \
                          uint8_t *dst, int scheme, int out) {                                 \
        if (scheme == SCHEME_INT8) {                                                           \
            if (out == OUT_F16) NAME##_of(src, row_stride, rows, d, dst, SCHEME_INT8, OUT_F16);  \
            else if (out == OUT_F32) NAME##_of(src, row_stride, rows, d, dst, SCHEME_INT8, OUT_F32); \
            else NAME##_of(src, row_stride, rows, d, dst, SCHEME_INT8, OUT_BF16);               \
        } else {                                                                               \
            if (out == OUT_F16) NAME##_of(src, row_stride, rows, d, dst, SCHEME_FP8, OUT_F16);   \
            else if (out == OUT_F32) NAME##_of(src, row_stride, rows, d, dst, SCHEME_FP8, OUT_F32); \
            else NAME##_of(src, row_stride, rows, d, dst, SCHEME_FP8, OUT_BF16);                \
        }                                                                                      \
    }

FB_ROWS(rows_avx2, row_avx2_of, FB_AVX2)

#define FB_AVX512 __attribute__((target("avx512f,avx512bw")))

/* Sixteen codes at src as float32 values (exact; fp8 as fp8_halves does). */
FB_AVX512 static inline __m512 codes16(const uint8_t *src, int scheme) {
    const __m128i b = _mm_loadu_si128((const __m128i *)src);
    if (scheme == SCHEME_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    const __m256i c = _mm256_cvtepu8_epi16(b);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x80)), 8);
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(mag, sign)), _mm512_set1_ps(256.0f));
}

FB_AVX512 static inline __attribute__((always_inline)) void row_avx512_of(const uint8_t *src, float s, void *dst, size_t d, int scheme,
                                 int out) {
    const __m512 vs = _mm512_set1_ps(s);
    size_t j = 0;
    for (; j + 16 <= d; j += 16) {
        const __m512 p = _mm512_mul_ps(codes16(src + j, scheme), vs);
        if (out == OUT_F32) {
            _mm512_storeu_ps((float *)dst + j, p);
        } else if (out == OUT_F16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + j),
                                _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT));
        } else {
            const __m512i u = _mm512_castps_si512(p);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
            const __m512i r = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
            _mm256_storeu_si256((__m256i *)((uint16_t *)dst + j), _mm512_cvtepi32_epi16(r));
        }
    }
    row_scalar(src, s, dst, j, d, scheme, out);
}

FB_ROWS(rows_avx512, row_avx512_of, FB_AVX512)

static int have_avx512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    }
    return known;
}

static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return known;
}
#endif

/* The widest loop this CPU runs: 0 portable, 1 AVX2 + F16C, 2 AVX-512; set_width() lowers it
 * (the tests check every loop this machine has against the Python path). */
static int width = -1;

static int widest(void) {
#if FB_X86
    return have_avx512() ? 2 : have_avx2() ? 1 : 0;
#else
    return 0;
#endif
}

/* CRC-32C by carry-less multiplication: 4 zmm registers of 4 128-bit lanes fold 256 bytes a
 * round (each lane multiplied by x^(2048 +- 32) mod P and XORed into the lane 2048 bits on), then
 * the lanes fold into one, the bytes after it fold 16 at a time, and the last 128-bit value and
 * the tail go through the SSE4.2 crc32 instruction. About 3x google_crc32c's 3-way crc32 loop on
 * an item just read (an AVX-512 core). Constants: bit-reflected x^n mod P, shifted left by one
 * (featbake/kernels.c's test compares every length 0-4096 and random buffers with google_crc32c). */
typedef uint32_t (*crc_fn_t)(uint32_t, const void *, size_t);

#if FB_X86
static int have_vpclmul(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = have_avx512() && __builtin_cpu_supports("avx512vl") &&
                __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
                __builtin_cpu_supports("sse4.2");
    }
    return known;
}

#define FB_CRC_TARGET __attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2")))

/* (x^(d+32) mod P, x^(d-32) mod P), reflected and shifted: the multipliers of a lane's low and
 * high 64 bits to move it d bits on. */
FB_CRC_TARGET static inline __m128i crc_k(uint64_t plus, uint64_t minus) {
    return _mm_set_epi64x((long long)minus, (long long)plus);
}

FB_CRC_TARGET static inline __m128i crc_fold128(__m128i x, __m128i k, __m128i with) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)), with);
}

FB_CRC_TARGET static inline __m512i crc_fold512(__m512i x, __m512i k, __m512i with) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), with, 0x96);
}

FB_CRC_TARGET static uint32_t crc32c_vpclmul(uint32_t crc, const uint8_t *p, size_t n) {
    /* n >= 256 */
    const __m512i k2048 = _mm512_broadcast_i32x4(crc_k(0xdcb17aa4u, 0xb9e02b86u));
    __m512i x0 = _mm512_loadu_si512((const void *)p);
    __m512i x1 = _mm512_loadu_si512((const void *)(p + 64));
    __m512i x2 = _mm512_loadu_si512((const void *)(p + 128));
    __m512i x3 = _mm512_loadu_si512((const void *)(p + 192));
    x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)~crc)));
    p += 256;
    n -= 256;
    for (; n >= 256; p += 256, n -= 256) {
        x0 = crc_fold512(x0, k2048, _mm512_loadu_si512((const void *)p));
        x1 = crc_fold512(x1, k2048, _mm512_loadu_si512((const void *)(p + 64)));
        x2 = crc_fold512(x2, k2048, _mm512_loadu_si512((const void *)(p + 128)));
        x3 = crc_fold512(x3, k2048, _mm512_loadu_si512((const void *)(p + 192)));
    }
    /* x0, x1, x2 onto x3's lanes (1536, 1024, 512 bits on), then its 4 lanes onto the last */
    x3 = crc_fold512(x0, _mm512_broadcast_i32x4(crc_k(0xa87ab8a8u, 0xab7aff2au)), x3);
    x3 = crc_fold512(x1, _mm512_broadcast_i32x4(crc_k(0x6992cea2u, 0x0d3b6092u)), x3);
    x3 = crc_fold512(x2, _mm512_broadcast_i32x4(crc_k(0x740eef02u, 0x9e4addf8u)), x3);
    const __m128i k128 = crc_k(0xf20c0dfeu, 0x14cd00bd6ull);
    __m128i acc = _mm512_extracti32x4_epi32(x3, 3);
    acc = crc_fold128(_mm512_extracti32x4_epi32(x3, 0), crc_k(0x1c291d04u, 0x1d82c63daull), acc);
    acc = crc_fold128(_mm512_extracti32x4_epi32(x3, 1), crc_k(0x1384aa63aull, 0xba4fc28eu), acc);
    acc = crc_fold128(_mm512_extracti32x4_epi32(x3, 2), k128, acc);
    for (; n >= 16; p += 16, n -= 16)
        acc = crc_fold128(acc, k128, _mm_loadu_si128((const __m128i *)p));
    uint64_t s = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(acc));
    s = _mm_crc32_u64(s, (uint64_t)_mm_extract_epi64(acc, 1));
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        s = _mm_crc32_u64(s, v);
    }
    uint32_t s32 = (uint32_t)s;
    for (; n; p++, n--) s32 = _mm_crc32_u8(s32, *p);
    return ~s32;
}
#endif

/* CRC-32C of n bytes at p extending crc: the folding loop where this CPU has it, the SIMD width
 * allows (set_width(2), the default there) and there are 256 bytes or more; else `fallback`
 * (google_crc32c's crc32c_extend). */
static uint32_t crc32c_extend(crc_fn_t fallback, uint32_t crc, const void *p, size_t n) {
#if FB_X86
    if (n >= 256 && width >= 2 && have_vpclmul()) return crc32c_vpclmul(crc, p, n);
#endif
    return fallback(crc, p, n);
}

/* The smallest non-zero and the largest finite row scale, and the rows whose scale is not
 * finite, as featbake.quantize.ScaleSpan keeps them. */
typedef struct {
    float low, high;
    long long damaged;
} scale_span_t;

static void span_rows(const uint8_t *src, size_t row_stride, size_t rows, size_t d,
                      scale_span_t *span) {
    for (size_t r = 0; r < rows; r++) {
        float s;
        memcpy(&s, src + r * row_stride + d, 4);
        if (!finite_scale(s)) {
            span->damaged++;
            continue;
        }
        if (s > 0 && s < span->low) span->low = s;
        if (s > span->high) span->high = s;
    }
}

static void dequant_rows(const uint8_t *src, size_t row_stride, size_t rows, size_t d,
                         uint8_t *dst, int scheme, int out, scale_span_t *span) {
    span_rows(src, row_stride, rows, d, span);
    if (width < 0) width = widest();
#if FB_X86
    if (width == 2) {
        rows_avx512(src, row_stride, rows, d, dst, scheme, out);
        return;
    }
    if (width == 1) {
        rows_avx2(src, row_stride, rows, d, dst, scheme, out);
        return;
    }
#endif
    const size_t out_row = d * (out == OUT_F32 ? 4 : 2);
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *row = src + r * row_stride;
        float s;
        memcpy(&s, row + d, 4);
        if (finite_scale(s))
            row_scalar(row, s, dst + r * out_row, 0, d, scheme, out);
        else
            nan_row(dst + r * out_row, d, out);
    }
}

static int valid_kind(int scheme, int out) {
    if (scheme != SCHEME_INT8 && scheme != SCHEME_FP8) {
        PyErr_SetString(PyExc_ValueError, "scheme must be 0 (int8) or 1 (fp8)");
        return 0;
    }
    if (out != OUT_F32 && out != OUT_F16 && out != OUT_BF16) {
        PyErr_SetString(PyExc_ValueError, "out must be 0 (float32), 1 (float16) or 2 (bfloat16)");
        return 0;
    }
    return 1;
}

/* d, the values of a packed row: >= 0, and d + 4 (its bytes) must not overflow. */
static int valid_width(Py_ssize_t d) {
    if (d < 0 || d > PY_SSIZE_T_MAX / 2) {
        PyErr_Format(PyExc_ValueError,
                     "d (the values of a packed row) must be >= 0 and < 2**62, got %zd", d);
        return 0;
    }
    return 1;
}

static PyObject *dequant(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t row_stride, rows, d;
    int scheme, out;
    if (!PyArg_ParseTuple(args, "KnnnKii", &src, &row_stride, &rows, &d, &dst, &scheme, &out))
        return NULL;
    if (!valid_kind(scheme, out) || !valid_width(d)) return NULL;
    if (rows < 0 || row_stride < d + 4) {
        PyErr_Format(PyExc_ValueError,
                     "dequant needs rows >= 0 and row_stride >= d + 4, got rows=%zd, "
                     "row_stride=%zd, d=%zd",
                     rows, row_stride, d);
        return NULL;
    }
    if (rows > 0 && d > 0 && (src == 0 || dst == 0)) {
        PyErr_SetString(PyExc_ValueError, "dequant needs the addresses of src and dst, got 0");
        return NULL;
    }
    scale_span_t span = {INFINITY, 0.0f, 0};
    Py_BEGIN_ALLOW_THREADS;
    dequant_rows((const uint8_t *)(uintptr_t)src, (size_t)row_stride, (size_t)rows, (size_t)d,
                 (uint8_t *)(uintptr_t)dst, scheme, out, &span);
    Py_END_ALLOW_THREADS;
    return Py_BuildValue("(ddL)", (double)span.low, (double)span.high, span.damaged);
}

typedef struct {
    int fd;
    long long offset;
    Py_ssize_t nbytes;
    unsigned long long dest, tail;
    Py_ssize_t tail_bytes;
    unsigned int head;
    long long want;
} span_t;

typedef struct {
    Py_ssize_t index;
    int kind, err;
} failure_t;

/* Read `n` bytes at `offset` into buf: 0, or 1 (short) / 3 (failed, errno in *err). */
static int read_exact(int fd, long long offset, uint8_t *buf, size_t n, int *err) {
    size_t got = 0;
    while (got < n) {
        const ssize_t k = pread(fd, buf + got, n - got, (off_t)(offset + (long long)got));
        if (k < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return 3;
        }
        if (k == 0) return 1;
        got += (size_t)k;
    }
    return 0;
}

static int read_one(const span_t *sp, crc_fn_t crc, uint8_t *scratch, int scheme, int out,
                    size_t d, int *err, scale_span_t *span) {
    uint8_t *into = scheme >= 0 ? scratch : (uint8_t *)(uintptr_t)sp->dest;
    const int kind = read_exact(sp->fd, sp->offset, into, (size_t)sp->nbytes, err);
    if (kind) return kind;
    if (sp->want >= 0 &&
        crc32c_extend(crc, (uint32_t)sp->head, into, (size_t)sp->nbytes) != (uint32_t)sp->want)
        return 2;
    if (scheme >= 0) {
        const long long damaged = span->damaged;
        dequant_rows(into, d + 4, (size_t)sp->nbytes / (d + 4), d, (uint8_t *)(uintptr_t)sp->dest,
                     scheme, out, span);
        if (span->damaged != damaged) return 4;
    }
    if (sp->tail_bytes > 0) memset((void *)(uintptr_t)sp->tail, 0, (size_t)sp->tail_bytes);
    return 0;
}

static int parse_spans(PyObject *seq, span_t *spans, Py_ssize_t n, int need_crc) {
    for (Py_ssize_t i = 0; i < n; i++) {
        span_t *sp = &spans[i];
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "iLnKKnIL", &sp->fd, &sp->offset,
                              &sp->nbytes, &sp->dest, &sp->tail, &sp->tail_bytes, &sp->head,
                              &sp->want))
            return 0;
        if (sp->offset < 0 || sp->nbytes < 0 || sp->tail_bytes < 0) {
            PyErr_Format(PyExc_ValueError,
                         "span %zd: offset, nbytes and tail_bytes must be >= 0, got %lld, %zd, %zd",
                         i, sp->offset, sp->nbytes, sp->tail_bytes);
            return 0;
        }
        if ((sp->nbytes > 0 && sp->dest == 0) || (sp->tail_bytes > 0 && sp->tail == 0)) {
            PyErr_Format(PyExc_ValueError, "span %zd: a dest or tail address of 0", i);
            return 0;
        }
        if (sp->want > (long long)UINT32_MAX || (sp->want >= 0 && !need_crc)) {
            PyErr_Format(PyExc_ValueError,
                         "span %zd: want must be a CRC-32C (< 2**32) with a crc_fn, or -1", i);
            return 0;
        }
    }
    return 1;
}

/* One thread's run of spans: [from, to), its scratch buffer, its first failure and its scales. */
typedef struct {
    const span_t *spans;
    Py_ssize_t from, to;
    crc_fn_t crc;
    int scheme, out;
    size_t d, most;
    failure_t fail;
    scale_span_t span;
    int nomem;
} run_t;

static void *run_spans(void *arg) {
    run_t *run = arg;
    uint8_t *scratch = NULL;
    if (run->scheme >= 0 && (scratch = malloc(run->most ? run->most : 1)) == NULL) {
        run->nomem = 1;
        return NULL;
    }
    for (Py_ssize_t i = run->from; i < run->to; i++) {
        const int kind = read_one(&run->spans[i], run->crc, scratch, run->scheme, run->out, run->d,
                                  &run->fail.err, &run->span);
        if (kind) {
            run->fail.index = i;
            run->fail.kind = kind;
            break;
        }
    }
    free(scratch);
    return NULL;
}

/* The threads that run a call's first runs, kept from call to call: starting a thread per run
 * and joining it cost 60-80 us a call on the 2-core benchmark machine (8% of reading a batch of
 * 32 fp16 [T, 768] items from the page cache), waking a waiting one a few. One call uses them at
 * a time; a call that finds them busy (another Python thread reading at once) starts threads of
 * its own, as every call did before. A forked child has none of its parent's threads: it starts
 * its own (pthread_atfork resets the pool there). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int started;                      /* workers running */
    int busy;                         /* a call is using them */
    unsigned long job;                /* bumped for each call */
    run_t *runs;                      /* that call's runs: worker t runs runs[t] for t < want */
    int want, left;                   /* workers it uses; of those, still running */
    unsigned long seen0[MAX_THREADS]; /* the job number when each worker was started */
} workers_t;

static workers_t workers = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_COND_INITIALIZER};

static void *worker(void *arg) {
    const int t = (int)(intptr_t)arg;
    pthread_mutex_lock(&workers.mu);
    unsigned long seen = workers.seen0[t];
    for (;;) {
        while (workers.job == seen) pthread_cond_wait(&workers.work, &workers.mu);
        seen = workers.job;
        if (t >= workers.want) continue;
        run_t *run = &workers.runs[t];
        pthread_mutex_unlock(&workers.mu);
        run_spans(run);
        pthread_mutex_lock(&workers.mu);
        if (--workers.left == 0) pthread_cond_signal(&workers.done);
    }
    return NULL;
}

static void workers_after_fork(void) {
    pthread_mutex_init(&workers.mu, NULL);
    pthread_cond_init(&workers.work, NULL);
    pthread_cond_init(&workers.done, NULL);
    workers.started = workers.busy = workers.want = workers.left = 0;
    workers.runs = NULL;
}

/* Start workers until `n` run (under workers.mu); whether they do. */
static int workers_up_to(int n) {
    while (workers.started < n) {
        pthread_attr_t attr;
        pthread_t tid;
        if (pthread_attr_init(&attr)) return 0;
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        workers.seen0[workers.started] = workers.job;
        const int failed =
            pthread_create(&tid, &attr, worker, (void *)(intptr_t)workers.started);
        pthread_attr_destroy(&attr);
        if (failed) return 0;
        workers.started++;
    }
    return 1;
}

/* Runs 0..k-2 on the kept workers, the last on this thread; 0 (nothing run) if they are busy or
 * cannot be started. Called without the GIL. */
static int run_on_workers(run_t *runs, int k) {
    pthread_mutex_lock(&workers.mu);
    if (workers.busy || !workers_up_to(k - 1)) {
        pthread_mutex_unlock(&workers.mu);
        return 0;
    }
    workers.busy = 1;
    workers.runs = runs;
    workers.want = workers.left = k - 1;
    workers.job++;
    pthread_cond_broadcast(&workers.work);
    pthread_mutex_unlock(&workers.mu);
    run_spans(&runs[k - 1]);
    pthread_mutex_lock(&workers.mu);
    while (workers.left) pthread_cond_wait(&workers.done, &workers.mu);
    workers.busy = 0;
    workers.runs = NULL;
    pthread_mutex_unlock(&workers.mu);
    return 1;
}

/* Every run to its end: the first ones on the kept workers (else on new threads), the last on
 * this one (a thread that cannot be started runs here too). Called without the GIL. */
static void run_all(run_t *runs, int k) {
    if (k > 1 && run_on_workers(runs, k)) return;
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int t = 0; t < k - 1; t++)
        started[t] = pthread_create(&tid[t], NULL, run_spans, &runs[t]) == 0;
    run_spans(&runs[k - 1]);
    for (int t = 0; t < k - 1; t++) {
        if (started[t])
            pthread_join(tid[t], NULL);
        else
            run_spans(&runs[t]);
    }
}

static int check_packed(const span_t *spans, Py_ssize_t n, int scheme, Py_ssize_t d,
                        size_t *most) {
    *most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (scheme >= 0 && spans[i].nbytes % (d + 4)) {
            PyErr_SetString(PyExc_ValueError, "a packed span is not whole rows of d + 4 bytes");
            return 0;
        }
        if ((size_t)spans[i].nbytes > *most) *most = (size_t)spans[i].nbytes;
    }
    return 1;
}

static PyObject *read_rows(PyObject *self, PyObject *args) {
    PyObject *arg, *seq;
    unsigned long long crc_addr;
    int scheme, out, threads = 1;
    Py_ssize_t d;
    if (!PyArg_ParseTuple(args, "OKiin|i", &arg, &crc_addr, &scheme, &out, &d, &threads))
        return NULL;
    if (scheme >= 0 && (!valid_kind(scheme, out) || !valid_width(d))) return NULL;
    seq = PySequence_Fast(arg, "spans must be a sequence of tuples");
    if (seq == NULL) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    span_t *spans = PyMem_RawMalloc(sizeof(span_t) * (size_t)(n ? n : 1));
    if (spans == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    size_t most = 0;
    const int ok =
        parse_spans(seq, spans, n, crc_addr != 0) && check_packed(spans, n, scheme, d, &most);
    Py_DECREF(seq);
    if (!ok) {
        PyMem_RawFree(spans);
        return NULL;
    }
    int k = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (k > n) k = n ? (int)n : 1;
    run_t runs[MAX_THREADS];
    const Py_ssize_t step = (n + k - 1) / k;
    for (int t = 0; t < k; t++) {
        const Py_ssize_t from = t * step, to = from + step < n ? from + step : n;
        runs[t] = (run_t){spans, from, to, (crc_fn_t)(uintptr_t)crc_addr, scheme, out, (size_t)d,
                          most, {-1, 0, 0}, {INFINITY, 0.0f, 0}, 0};
    }
    Py_BEGIN_ALLOW_THREADS;
    run_all(runs, k);
    Py_END_ALLOW_THREADS;
    PyMem_RawFree(spans);
    failure_t fail = {-1, 0, 0};
    scale_span_t span = {INFINITY, 0.0f, 0};
    int nomem = 0;
    for (int t = 0; t < k; t++) {
        nomem |= runs[t].nomem;
        if (fail.index < 0 && runs[t].fail.index >= 0) fail = runs[t].fail;
        if (runs[t].span.low < span.low) span.low = runs[t].span.low;
        if (runs[t].span.high > span.high) span.high = runs[t].span.high;
    }
    if (nomem) return PyErr_NoMemory();
    if (fail.index < 0) return Py_BuildValue("(Odd)", Py_None, (double)span.low, (double)span.high);
    return Py_BuildValue("((nii)dd)", fail.index, fail.kind, fail.err, (double)span.low,
                         (double)span.high);
}

/* crc32c(crc, address, nbytes, fallback): CRC-32C of nbytes at address extending crc, as
 * read_rows checks a span (fallback: the address of google_crc32c's crc32c_extend); outside the
 * GIL from 64 KiB on. */
static PyObject *crc32c(PyObject *self, PyObject *args) {
    unsigned int crc;
    unsigned long long at, fallback;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "IKnK", &crc, &at, &n, &fallback)) return NULL;
    if (n < 0 || (n > 0 && at == 0) || fallback == 0) {
        PyErr_SetString(PyExc_ValueError, "crc32c needs nbytes >= 0, an address and a fallback");
        return NULL;
    }
    const crc_fn_t fn = (crc_fn_t)(uintptr_t)fallback;
    uint32_t got;
    if (n >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS;
        got = crc32c_extend(fn, crc, (const void *)(uintptr_t)at, (size_t)n);
        Py_END_ALLOW_THREADS;
    } else {
        got = n ? crc32c_extend(fn, crc, (const void *)(uintptr_t)at, (size_t)n) : crc;
    }
    return PyLong_FromUnsignedLong(got);
}

/* set_width(n): use the loop of width min(n, widest) (0 portable, 1 AVX2, 2 AVX-512); returns
 * the width now used. set_width(-1) returns it unchanged. */
static PyObject *set_width(PyObject *self, PyObject *arg) {
    const long asked = PyLong_AsLong(arg);
    if (asked == -1 && PyErr_Occurred()) return NULL;
    const int most = widest();
    if (asked >= 0) width = asked < most ? (int)asked : most;
    else if (width < 0) width = most;
    return PyLong_FromLong(width);
}

static PyMethodDef methods[] = {
    {"dequant", dequant, METH_VARARGS, "Packed int8/fp8 rows into float32/float16/bfloat16."},
    {"read_rows", read_rows, METH_VARARGS, "A batch's preads, checks, dequantising, padding."},
    {"crc32c", crc32c, METH_VARARGS, "CRC-32C of a buffer at an address, extending a CRC."},
    {"set_width", set_width, METH_O, "The SIMD width used: 0 portable, 1 AVX2, 2 AVX-512."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "featbake.kernels",
                                    "A batch's reads and dequantising outside the GIL.", -1,
                                    methods};

PyMODINIT_FUNC PyInit_kernels(void) {
    static int registered = 0;
    if (!registered && pthread_atfork(NULL, NULL, workers_after_fork) == 0) registered = 1;
    if (width < 0) width = widest();
    return PyModule_Create(&module);
}
