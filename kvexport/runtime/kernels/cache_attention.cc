// kvexport's CPU attention over an in-place fp32 cache, for ONNX Runtime: decode calls and prompts.
//
// The op `kvexport.CacheAttention` means what com.microsoft.GroupQueryAttention means over a
// shared past/present buffer, without rotary, softcap or head sink:
//   inputs  query [B, S, N*D], key [B, S, Nkv*D], value [B, S, Nkv*D],
//           past_key [B, Nkv, C, D], past_value [B, Nkv, C, D], seqlens_k [B] (int32: a row's last position),
//           attention_bias (optional) [B or 1, N or 1, S or 1, T] added to the scores,
//           block_table (optional) [B, W] (int32): the paged layout, below
//   outputs output [B, S, N*D], present_key, present_value [B, Nkv, C, D] ([Nkv, P, Bs, D] paged)
//   attributes num_heads, kv_num_heads, scale (0: 1/sqrt(D)), local_window_size (-1: none)
// A row's S new keys and values go after its max(0, seqlens_k + 1 - S) cached ones (a first
// prompt's rows may be right padded); query s attends to the positions up to its own and to
// seqlens_k, the last local_window_size of them where that is set. Where present is bound to
// past's buffer (the in-place cache) only the new rows are written. Several rows after pasts
// of different lengths are taken too (the op refuses them).
//
// Paged (a block_table given): the cache is a pool of blocks [Nkv, P, Bs, D] shared by every row (an fp32, fp16 or q8
// pool; q8: [Nkv, P, Bs, D + 4], a position's D int8 codes then its fp32 scale, below),
// and row b's position t lives in block block_table[b, t / Bs] at t % Bs; a row holds W * Bs
// positions. Head-major, so a KV head's consecutive blocks are one run of memory: with the blocks
// [P, Nkv, Bs, D], a 16-row decode call's attention read the fp32 cache 14% slower than rows of
// their own (SmolLM2-135M, 560 positions a row, 2 Xeon cores: bandwidth-bound at 28 ms a call). Only the blocks a row's positions reach are read or written; the engine's block
// manager (kvexport/serving/blocks.py) hands them out, so memory follows the tokens in use.
//
// Why (2 Zen 5 cores; kvexport/passes/cache_attention.py has the numbers):
// - one token a row: ONNX Runtime 1.31.1's op reads the fp32 cache at about 22 GB/s where the
//   cores stream 38 GB/s, and every query head reads its group's keys again. Here a task takes
//   a row's KV head and reads each key and value once for the group's query heads.
// - several: the op scores every key, the queries' future too. Here a task takes 16 queries
//   of a row's KV head (their rows are the queries x the group's heads) over the keys up to its
//   last query only, as AVX-512 register tiles: scores against the keys transposed once a
//   call, then the weighted sum of the values.
// The tasks run on the session's own intra-op threads.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

bool kvexport_amx_allowed();  // prompt_matmul.cc: the CPU has AMX-BF16 and the OS granted its tile data
void kvexport_configure_tiles();  // prompt_matmul.cc: this thread's eight tiles, 16 rows of 64 bytes each

namespace {

// Where a row's cached positions live: rows of their own ([B, Nkv, C, D]) or a block table's
// blocks of a pool ([Nkv, P, Bs, D]).
struct Layout {
  const int32_t* table;  // null: the row layout
  int64_t width, block_size, kv_heads, head_size, blocks;  // block_size: C for rows; blocks: P
  int64_t row;  // elements a cached position takes: head_size, or (an 8-bit pool) head_size + its scale's 4 bytes

  // offset of row b's KV head h at position t, in the cache's elements
  int64_t at(int64_t b, int64_t h, int64_t t) const {
    if (table == nullptr) return ((b * kv_heads + h) * block_size + t) * row;
    return ((h * blocks + table[b * width + t / block_size]) * block_size + t % block_size) * row;
  }

  // positions from t on that lie contiguously after t's (to the end of its block), at most n
  int64_t run(int64_t t, int64_t n) const { return table == nullptr ? n : std::min(n, block_size - t % block_size); }
};

// ---- an fp16 cache: stored as IEEE half, read a run at a time into fp32 ----
// The hand-written paths, the CPU's best unless KVEXPORT_ATTENTION_PATH=avx512|f16c|generic narrows them when the ops
// are registered (choose_paths): the fp16 conversions and the AVX-512 loops; the loops the compiler vectorizes stay
// (target_clones). Tests run every path the host has.
bool kAvx512 = __builtin_cpu_supports("avx512f");
bool kF16c = __builtin_cpu_supports("f16c");
// Prompts on AMX tiles where a node asks (bf16_tiles: the prompt session's) and the CPU and OS allow them, unless
// KVEXPORT_ATTENTION_PATH narrows the paths (avx512, f16c, generic: fp32). Every operand as two bf16 parts (about 2^-16
// of fp32's results): a 512-token prompt of SmolLM2-135M 0.93x the time; served on 4,096 tokens its perplexity, top-1
// and mean KL against fp32 within the fp32 path's own noise, both ways (docs/benchmarks.md).
bool kTiles = false;

void choose_paths() {
  const char* forced = std::getenv("KVEXPORT_ATTENTION_PATH");
  const std::string choice = forced != nullptr ? forced : "";
  kAvx512 = __builtin_cpu_supports("avx512f");  // each registration reads the variable afresh
  kF16c = __builtin_cpu_supports("f16c");
  kTiles = false;
  if (choice.empty() || choice == "auto") {
    kTiles = kvexport_amx_allowed();
    return;
  }
  if (choice == "amx") {
    if (!kvexport_amx_allowed()) throw std::runtime_error("CacheAttention: KVEXPORT_ATTENTION_PATH=amx but this CPU (or the OS) gives no AMX tiles");
    kTiles = true;
    return;
  }
  if (choice == "generic") {
    kAvx512 = kF16c = false;
  } else if (choice == "f16c") {
    if (!__builtin_cpu_supports("f16c")) throw std::runtime_error("CacheAttention: KVEXPORT_ATTENTION_PATH=f16c but this CPU has no F16C");
    kAvx512 = false;
  } else if (choice == "avx512") {
    if (!kAvx512) throw std::runtime_error("CacheAttention: KVEXPORT_ATTENTION_PATH=avx512 but this CPU has no AVX-512");
  } else {
    throw std::runtime_error("CacheAttention: KVEXPORT_ATTENTION_PATH=" + choice + " is not amx, avx512, f16c, generic or auto");
  }
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits = sign;
  if (exp == 31) {
    bits |= 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits |= ((exp + 112) << 23) | (mant << 13);
  } else if (mant != 0) {  // subnormal: mant * 2^-24
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign != 0 ? -magnitude : magnitude;
  }
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

uint16_t float_to_half(float value) {  // round to nearest even, as vcvtps2ph's mode 0
  uint32_t x;
  std::memcpy(&x, &value, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000, biased = (x >> 23) & 0xff;
  uint32_t mant = x & 0x7fffff;
  if (biased == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant != 0 ? 0x200 : 0));
  const int32_t exp = static_cast<int32_t>(biased) - 127 + 15;
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1), middle = 1u << (shift - 1);
    if (rest > middle || (rest == middle && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) ++half;  // a carry into the exponent is the right rounding
  return static_cast<uint16_t>(half);
}

__attribute__((target("avx512f"))) void to_float_avx512(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}

__attribute__((target("avx,f16c"))) void to_float_f16c(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}

__attribute__((target("avx512f"))) void to_half_avx512(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = float_to_half(in[i]);
}

__attribute__((target("avx,f16c"))) void to_half_f16c(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = float_to_half(in[i]);
}

void to_float(const uint16_t* in, float* out, int64_t n) {
  if (kAvx512) return to_float_avx512(in, out, n);
  if (kF16c) return to_float_f16c(in, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = half_to_float(in[i]);
}

void to_half(const float* in, uint16_t* out, int64_t n) {
  if (kAvx512) return to_half_avx512(in, out, n);
  if (kF16c) return to_half_f16c(in, out, n);
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_half(in[i]);
}

// ---- an 8-bit pool (q8): a position's head as D int8 codes, then its scale (fp32, 4 bytes): x ~ code * scale, the
// scale the head's largest magnitude / 127, set as the position is written (llama.cpp's q8_0 cache: one a 32 values) ----
constexpr int64_t kScaleBytes = 4;

inline float q8_scale(const int8_t* position, int64_t D) {
  float scale;
  std::memcpy(&scale, position + D, sizeof scale);
  return scale;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void to_q8(const float* in, int8_t* out, int64_t D) {
  float top = 0.0f;
  for (int64_t d = 0; d < D; ++d) top = std::max(top, std::fabs(in[d]));
  // a head of (nearly) zeros keeps zero codes and scale (127 / top would overflow below FLT_MIN)
  const float scale = top / 127.0f, inverse = top > std::numeric_limits<float>::min() ? 127.0f / top : 0.0f;
  for (int64_t d = 0; d < D; ++d) out[d] = static_cast<int8_t>(std::nearbyint(std::min(127.0f, std::max(-127.0f, in[d] * inverse))));
  std::memcpy(out + D, &scale, sizeof scale);
}

// ``count`` positions of D values from a q8 pool (``stride`` elements apart) as fp32, one after another in ``out``
__attribute__((target_clones("avx512f", "avx2", "default"))) void q8_to_float(const int8_t* in, int64_t stride, int64_t D, int64_t count,
                                                                               float* out) {
  for (int64_t r = 0; r < count; ++r, in += stride, out += D) {
    const float scale = q8_scale(in, D);
    for (int64_t d = 0; d < D; ++d) out[d] = static_cast<float>(in[d]) * scale;
  }
}

enum class Kind { kF32, kF16, kQ8 };

constexpr int64_t element_bytes(Kind kind) { return kind == Kind::kF32 ? 4 : kind == Kind::kF16 ? 2 : 1; }

// A cache tensor as the kernel reads it: fp32 in place, or fp16 / q8 converted a run at a time into a buffer.
struct CacheView {
  const float* f32;
  const uint16_t* f16;  // set for an fp16 cache (the others null)
  const int8_t* q8;     // set for an 8-bit pool
  int64_t head_size, row;  // D, and the elements a position takes (q8: D + the scale's bytes)

  Kind kind() const { return q8 != nullptr ? Kind::kQ8 : f16 != nullptr ? Kind::kF16 : Kind::kF32; }

  // ``count`` values (whole positions, a multiple of D) from offset ``at`` as fp32: the cache itself, or their
  // conversion in ``buffer``
  const float* values(int64_t at, int64_t count, float* buffer) const {
    if (q8 != nullptr) {
      q8_to_float(q8 + at, row, head_size, count / head_size, buffer);
      return buffer;
    }
    if (f16 == nullptr) return f32 + at;
    to_float(f16 + at, buffer, count);
    return buffer;
  }
};

struct Problem {
  const float* query;
  float* output;
  CacheView past_key;  // present's buffer once the new rows are in it
  CacheView past_value;
  const int32_t* seqlens;
  const float* bias;  // null, or [bias_b, bias_h, 1, bias_t]
  int64_t bias_b, bias_h, bias_t;
  int64_t heads, kv_heads, head_size, window;
  Layout layout;
  float scale;
};

// A decode row's scores (G heads x n keys from position start): the padding bias added, then each head's softmax.
// Inlined into each caller, so its loops (and the exponentials) take the caller's ISA.
__attribute__((always_inline)) inline void biased_softmax(const Problem& p, int64_t b, int64_t kvh, int64_t start, int64_t n,
                                                          float* scores) {
  const int64_t G = p.heads / p.kv_heads;
  if (p.bias != nullptr)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kvh * G + g;
      const float* row = p.bias + ((p.bias_b == 1 ? 0 : b) * p.bias_h + (p.bias_h == 1 ? 0 : h)) * p.bias_t + start;
      for (int64_t t = 0; t < n; ++t) scores[g * n + t] += row[t];
    }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * n;
    float top = std::numeric_limits<float>::lowest();  // finite: built with -ffast-math
    for (int64_t t = 0; t < n; ++t) top = std::max(top, s[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - top);
      sum += s[t];
    }
    const float inverse = 1.0f / sum;
    for (int64_t t = 0; t < n; ++t) s[t] *= inverse;
  }
}

// One row's KV head: scores of its group's query heads, softmax, the weighted sum of values. ``keys(at, count)`` and
// ``values(at, count)`` give a run of the cache from offset ``at`` as fp32 (inlined: the fp32 cache's loops stay as
// they were; a branch between the two kinds in the loops took the fp32 cache's decode call from 55 to 103 ms).
template <class Read>
__attribute__((always_inline)) inline void attend_with(const Problem& p, int64_t b, int64_t kvh, std::vector<float>& scores,
                                                       Read keys, Read values) {
  const int64_t D = p.head_size, G = p.heads / p.kv_heads;
  const int64_t last = p.seqlens[b];
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, last + 1 - p.window) : 0;
  const int64_t n = last + 1 - start;
  scores.resize(static_cast<size_t>(G * n));
  const float* q = p.query + (b * p.heads + kvh * G) * D;
  for (int64_t t0 = 0; t0 < n;) {  // a block's positions at a time: one address computed a run
    const int64_t run = p.layout.run(start + t0, n - t0);
    const float* k = keys(p.layout.at(b, kvh, start + t0), run * D);
    for (int64_t t = t0; t < t0 + run; ++t, k += D)
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
        scores[g * n + t] = dot * p.scale;
      }
    t0 += run;
  }
  biased_softmax(p, b, kvh, start, n, scores.data());
  float* out = p.output + (b * p.heads + kvh * G) * D;
  std::fill(out, out + G * D, 0.0f);
  for (int64_t t0 = 0; t0 < n;) {
    const int64_t run = p.layout.run(start + t0, n - t0);
    const float* v = values(p.layout.at(b, kvh, start + t0), run * D);
    for (int64_t t = t0; t < t0 + run; ++t, v += D)
      for (int64_t g = 0; g < G; ++g) {
        const float weight = scores[g * n + t];
        float* og = out + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += weight * v[d];
      }
    t0 += run;
  }
}

struct ReadFloat {
  const float* cache;
  const float* operator()(int64_t at, int64_t) const { return cache + at; }
};

struct ReadConverted {  // converts a run (at most a block, or a row's every position) into the buffer
  CacheView cache;
  float* buffer;
  const float* operator()(int64_t at, int64_t count) const { return cache.values(at, count, buffer); }
};

__attribute__((target_clones("avx512f", "avx2", "default")))
void attend(const Problem& p, int64_t b, int64_t kvh, std::vector<float>& scores) {
  attend_with(p, b, kvh, scores, ReadFloat{p.past_key.f32}, ReadFloat{p.past_value.f32});
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void attend_converted(const Problem& p, int64_t b, int64_t kvh, std::vector<float>& scores, std::vector<float>& buffer) {
  const int64_t last = p.seqlens[b], window = p.window > 0 ? std::min<int64_t>(p.window, last + 1) : last + 1;
  buffer.resize(static_cast<size_t>((p.layout.table == nullptr ? window : std::min(window, p.layout.block_size)) * p.head_size));
  attend_with(p, b, kvh, scores, ReadConverted{p.past_key, buffer.data()}, ReadConverted{p.past_value, buffer.data()});
}

// ---- one token a row on AVX-512 (a head size of a multiple of 16, at most 256): the cache's runs read once, fp32 or
// fp16; a KV head's query heads (at most 8) share each run ----
// The scores take 16 keys at a time: 16 accumulators of q . k, summed across their lanes into one vector (sum16), not
// one horizontal sum a key (whose latency bound the old loop: 9.7 GB/s read of 13 over an fp16 pool); an fp16 run is
// converted once into a buffer the group's heads read from L1; a paged row's next block is prefetched. 64 rows at 582
// positions over an fp16 pool, SmolLM2-135M's 30 layers (2 Xeon cores): 88 -> 58-66 ms with the blocks in order,
// 116 -> 76-89 ms shuffled (a pool after churn; 2 KB blocks read at random stream worse than in order).
constexpr int64_t kMaxGroup = 8, kMaxChunks = 16, kKeys = 16;

template <Kind K>
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const void* cache, int64_t at) {  // q8: the codes, unscaled
  if constexpr (K == Kind::kF16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(cache) + at)));
  else if constexpr (K == Kind::kQ8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(cache) + at))));
  else
    return _mm512_loadu_ps(static_cast<const float*>(cache) + at);
}

// lane i of the result: the sum of v[i]'s 16 lanes
__attribute__((target("avx512f"), always_inline)) inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-1: v[2i]'s halves summed, lanes 2-3: v[2i+1]'s
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: v[4i+L]'s four partial sums
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));  // 4L+e: v[4e+L]
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), d);
}

// A paged row's block kAhead blocks after position t's (the first time, every block up to it) into L1, ahead of its
// reading; ``end``: the row's positions stop there.
constexpr int64_t kAhead = 1;

template <Kind K>
__attribute__((always_inline)) inline void prefetch_ahead(const Problem& p, const void* cache, int64_t b, int64_t kvh, int64_t t,
                                                          int64_t end, bool first) {
  const int64_t bs = p.layout.block_size, block = t / bs;
  for (int64_t j = first ? block + 1 : block + kAhead; j <= block + kAhead && j * bs < end; ++j) {
    const char* line = static_cast<const char*>(cache) + p.layout.at(b, kvh, j * bs) * element_bytes(K);
    const int64_t bytes = std::min(bs, end - j * bs) * p.layout.row * element_bytes(K);
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(line + at, _MM_HINT_T0);
  }
}

template <Kind K>
__attribute__((target("avx512f"))) void attend_avx512(const Problem& p, int64_t b, int64_t kvh, std::vector<float>& scores) {
  const int64_t D = p.head_size, G = p.heads / p.kv_heads, chunks = D / 16, row = p.layout.row;
  const int64_t last = p.seqlens[b];
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, last + 1 - p.window) : 0;
  const int64_t n = last + 1 - start;
  const bool paged = p.layout.table != nullptr;
  scores.resize(static_cast<size_t>(G * n + kKeys));
  alignas(64) float keys_f32[kKeys * 16 * kMaxChunks];  // a run of 16 keys as fp32 (fp16 runs, and every run's tail)
  const auto pointer = [](const CacheView& view) -> const void* {
    return K == Kind::kQ8 ? static_cast<const void*>(view.q8) : K == Kind::kF16 ? static_cast<const void*>(view.f16) : view.f32;
  };
  const void* keys = pointer(p.past_key);
  const void* values = pointer(p.past_value);
  const float* q = p.query + (b * p.heads + kvh * G) * D;
  for (int64_t t0 = 0; t0 < n;) {
    const int64_t run = p.layout.run(start + t0, n - t0);
    const int64_t at0 = p.layout.at(b, kvh, start + t0);
    if (paged) prefetch_ahead<K>(p, keys, b, kvh, start + t0, start + n, t0 == 0);
    for (int64_t sub = 0; sub < run; sub += kKeys) {
      const int64_t m = std::min<int64_t>(kKeys, run - sub), at = at0 + sub * row;
      const float* k = keys_f32;  // fp32 keys are read in place where a whole run of 16 is there (below)
      if constexpr (K == Kind::kF32)
        if (m == kKeys) k = static_cast<const float*>(keys) + at;
      __m512 key_scales = _mm512_set1_ps(p.scale);
      if (K == Kind::kQ8) {  // the codes as they are; each key's scale goes into its score
        alignas(64) float scales[kKeys] = {};
        for (int64_t j = 0; j < m; ++j) {
          scales[j] = q8_scale(static_cast<const int8_t*>(keys) + at + j * row, D) * p.scale;
          for (int64_t c = 0; c < chunks; ++c) _mm512_store_ps(keys_f32 + j * D + 16 * c, load16<K>(keys, at + j * row + 16 * c));
        }
        key_scales = _mm512_load_ps(scales);
        std::fill(keys_f32 + m * D, keys_f32 + kKeys * D, 0.0f);
        k = keys_f32;
      } else if (K == Kind::kF16 || m < kKeys) {
        for (int64_t i = 0; i < m * chunks; ++i) _mm512_store_ps(keys_f32 + 16 * i, load16<K>(keys, at + 16 * i));
        std::fill(keys_f32 + m * D, keys_f32 + kKeys * D, 0.0f);
        k = keys_f32;
      }
      for (int64_t g = 0; g < G; ++g) {
        __m512 acc[kKeys];
        for (int64_t i = 0; i < kKeys; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512 qc = _mm512_loadu_ps(q + g * D + 16 * c);
          for (int64_t i = 0; i < kKeys; ++i) acc[i] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k + i * D + 16 * c), acc[i]);
        }
        _mm512_mask_storeu_ps(scores.data() + g * n + t0 + sub, static_cast<__mmask16>((1u << m) - 1),
                              _mm512_mul_ps(sum16(acc), key_scales));
      }
    }
    t0 += run;
  }
  biased_softmax(p, b, kvh, start, n, scores.data());
  __m512 out[kMaxGroup * kMaxChunks / 4];  // the group's outputs, 4 chunks of D at a time, kept in registers over the row
  float* output = p.output + (b * p.heads + kvh * G) * D;
  for (int64_t c0 = 0; c0 < chunks; c0 += 4) {
    const int64_t width = std::min<int64_t>(4, chunks - c0);
    for (int64_t i = 0; i < G * 4; ++i) out[i] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < n;) {
      const int64_t run = p.layout.run(start + t0, n - t0);
      if (paged) prefetch_ahead<K>(p, values, b, kvh, start + t0, start + n, t0 == 0);
      int64_t at = p.layout.at(b, kvh, start + t0);
      for (int64_t t = t0; t < t0 + run; ++t, at += row) {
        // q8: the value's scale goes into the weights (the codes are summed as they are)
        const float scale = K == Kind::kQ8 ? q8_scale(static_cast<const int8_t*>(values) + at, D) : 1.0f;
        __m512 weight[kMaxGroup];
        for (int64_t g = 0; g < G; ++g) weight[g] = _mm512_set1_ps(scores[g * n + t] * scale);
        for (int64_t c = 0; c < width; ++c) {
          const __m512 v = load16<K>(values, at + 16 * (c0 + c));
          for (int64_t g = 0; g < G; ++g) out[g * 4 + c] = _mm512_fmadd_ps(weight[g], v, out[g * 4 + c]);
        }
      }
      t0 += run;
    }
    for (int64_t g = 0; g < G; ++g)
      for (int64_t c = 0; c < width; ++c) _mm512_storeu_ps(output + g * D + 16 * (c0 + c), out[g * 4 + c]);
  }
}

void attend_task(void* data, size_t index) {
  thread_local std::vector<float> scores, buffer;
  const Problem& p = *static_cast<const Problem*>(data);
  const auto i = static_cast<int64_t>(index);
  const int64_t b = i / p.kv_heads, kvh = i % p.kv_heads, G = p.heads / p.kv_heads;
  const Kind kind = p.past_key.kind();
  if (kAvx512 && p.head_size % 16 == 0 && p.head_size <= 16 * kMaxChunks && G <= kMaxGroup) {
    if (kind == Kind::kQ8)
      attend_avx512<Kind::kQ8>(p, b, kvh, scores);
    else if (kind == Kind::kF16)
      attend_avx512<Kind::kF16>(p, b, kvh, scores);
    else
      attend_avx512<Kind::kF32>(p, b, kvh, scores);
  } else if (kind != Kind::kF32) {
    attend_converted(p, b, kvh, scores, buffer);
  } else {
    attend(p, b, kvh, scores);
  }
}


// ---- several tokens a row: queries in blocks, keys transposed once a row's KV head ----
constexpr int64_t kQueryBlock = 16;  // queries a task; its rows are the block's queries x the group's heads

struct Prompt {
  const float* query;  // [B, S, N*D]
  float* output;
  const float* keys_t;  // [B, Nkv, D, T_pad]: the cache's keys transposed, up to each row's last
  const float* values;  // present's values [B, Nkv, C, D], or (paged) gathered [B, Nkv, T_pad, D]
  const int32_t* seqlens;
  const float* bias;
  int64_t bias_b, bias_h, bias_s, bias_t;
  int64_t tokens, heads, kv_heads, head_size, values_stride, window, t_pad, blocks;  // values_stride: C or T_pad
  float scale;
};

template <class P>
int64_t past_of(const P& p, int64_t b) { return std::max<int64_t>(0, static_cast<int64_t>(p.seqlens[b]) + 1 - p.tokens); }

// Query s of a prompt task's block, head g of its group: its scores (times ``scale``, the bias added) as softmax weights
// in place, zero outside its window and after its position up to ``width``; the inverse of their sum in ``inverse``.
// Returns the first key it weighs. Inlined: its loops (and libmvec's exp) take the caller's ISA.
template <class P>
__attribute__((always_inline)) inline int64_t row_softmax(const P& p, int64_t b, int64_t kvh, int64_t first, int64_t s, int64_t g,
                                                          int64_t width, float scale, float* row, float& inverse) {
  // a right-padded row's padding queries (past its last key) see what its last query sees
  const int64_t position = std::min(past_of(p, b) + first + s, static_cast<int64_t>(p.seqlens[b]));
  const int64_t end = position + 1;
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, position + 1 - p.window) : 0;
  if (scale != 1.0f)
#pragma omp simd
    for (int64_t t = start; t < end; ++t) row[t] *= scale;
  if (p.bias != nullptr) {
    const int64_t h = kvh * (p.heads / p.kv_heads) + g;
    const float* add = p.bias + (((p.bias_b == 1 ? 0 : b) * p.bias_h + (p.bias_h == 1 ? 0 : h)) * p.bias_s +
                                 (p.bias_s == 1 ? 0 : first + s)) * p.bias_t;
#pragma omp simd
    for (int64_t t = start; t < end; ++t) row[t] += add[t];
  }
  float top = std::numeric_limits<float>::lowest();
  for (int64_t t = start; t < end; ++t) top = std::max(top, row[t]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = start; t < end; ++t) {
    row[t] = std::exp(row[t] - top);
    sum += row[t];
  }
  inverse = 1.0f / sum;
  std::fill(row, row + start, 0.0f);
  std::fill(row + end, row + width, 0.0f);
  return start;
}

// A prompt task's share: row b's KV head kvh, queries first..first+count-1, over the keys before ``keys`` (up to its
// last query's position, or the row's last key)
struct QueryBlock {
  int64_t b, kvh, first, count, keys;
};

template <class P>
QueryBlock query_block(const P& p, size_t index) {
  const auto i = static_cast<int64_t>(index);
  const int64_t block = i % p.blocks, kvh = (i / p.blocks) % p.kv_heads, b = i / (p.blocks * p.kv_heads);
  const int64_t first = block * kQueryBlock, count = std::min(kQueryBlock, p.tokens - first);
  const int64_t keys = std::min(past_of(p, b) + first + count - 1, static_cast<int64_t>(p.seqlens[b])) + 1;
  return {b, kvh, first, count, keys};
}

// scores[r][t] = scale * q_r . k_t for 8 rows and 32 keys at a time (16 accumulators); rows padded to 8, keys to 32
__attribute__((target("avx512f"))) void scores_avx512(const float* const* q, const float* kt, int64_t t_pad, int64_t D,
                                                       int64_t keys, float scale, float* scores, int64_t stride, int64_t rows) {
  constexpr int kRows = 8;
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const float* qr[kRows];
    for (int i = 0; i < kRows; ++i) qr[i] = q[std::min<int64_t>(r0 + i, rows - 1)];
    for (int64_t t0 = 0; t0 < keys; t0 += 32) {
      __m512 a[kRows][2];
      for (auto& row : a) row[0] = row[1] = _mm512_setzero_ps();
      const float* k = kt + t0;
      for (int64_t d = 0; d < D; ++d, k += t_pad) {
        const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16);
#pragma GCC unroll 8
        for (int i = 0; i < kRows; ++i) {
          const __m512 x = _mm512_set1_ps(qr[i][d]);
          a[i][0] = _mm512_fmadd_ps(x, k0, a[i][0]);
          a[i][1] = _mm512_fmadd_ps(x, k1, a[i][1]);
        }
      }
      const int64_t n = std::min<int64_t>(kRows, rows - r0);
      for (int64_t i = 0; i < n; ++i) {
        float* o = scores + (r0 + i) * stride + t0;
        _mm512_storeu_ps(o, _mm512_mul_ps(a[i][0], s));
        _mm512_storeu_ps(o + 16, _mm512_mul_ps(a[i][1], s));
      }
    }
  }
}

void scores_generic(const float* const* q, const float* kt, int64_t t_pad, int64_t D, int64_t keys, float scale,
                    float* scores, int64_t stride, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = scores + r * stride;
    std::fill(o, o + keys, 0.0f);
    for (int64_t d = 0; d < D; ++d) {
      const float x = q[r][d];
      const float* k = kt + d * t_pad;
#pragma omp simd
      for (int64_t t = 0; t < keys; ++t) o[t] += x * k[t];
    }
#pragma omp simd
    for (int64_t t = 0; t < keys; ++t) o[t] *= scale;
  }
}

// out_r = sum_t w[r][t] v_t / sum_r for 6 rows at a time (24 accumulators), 64 values of a row at a time
__attribute__((target("avx512f"))) void weighted_avx512(const float* weights, int64_t stride, int64_t from, int64_t keys,
                                                         const float* values, int64_t D, float* const* out,
                                                         const float* inverses, int64_t rows) {
  constexpr int kRows = 6;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t n = std::min<int64_t>(kRows, rows - r0);
    const float* w[kRows];
    for (int i = 0; i < kRows; ++i) w[i] = weights + std::min<int64_t>(r0 + i, rows - 1) * stride;
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m512 acc[kRows][4];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      for (int64_t t = from; t < keys; ++t) {
        const float* v = values + t * D + d0;
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
#pragma GCC unroll 6
        for (int i = 0; i < kRows; ++i) {
          const __m512 x = _mm512_set1_ps(w[i][t]);
          acc[i][0] = _mm512_fmadd_ps(x, v0, acc[i][0]);
          acc[i][1] = _mm512_fmadd_ps(x, v1, acc[i][1]);
          acc[i][2] = _mm512_fmadd_ps(x, v2, acc[i][2]);
          acc[i][3] = _mm512_fmadd_ps(x, v3, acc[i][3]);
        }
      }
      for (int64_t i = 0; i < n; ++i) {
        const __m512 inverse = _mm512_set1_ps(inverses[r0 + i]);
        for (int64_t j = 0; j < 4; ++j) _mm512_storeu_ps(out[r0 + i] + d0 + 16 * j, _mm512_mul_ps(acc[i][j], inverse));
      }
    }
  }
}

void weighted_generic(const float* weights, int64_t stride, int64_t from, int64_t keys, const float* values, int64_t D,
                      float* const* out, const float* inverses, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out[r];
    std::fill(o, o + D, 0.0f);
    for (int64_t t = from; t < keys; ++t) {
      const float w = weights[r * stride + t];
      const float* v = values + t * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * v[d];
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inverses[r];
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))  // the softmax's loops (and libmvec's exp) at the CPU's width
void prompt_task(void* data, size_t index) {
  thread_local std::vector<float> scores;
  thread_local std::vector<const float*> queries;
  thread_local std::vector<float*> outs;
  thread_local std::vector<float> inverses;
  const Prompt& p = *static_cast<const Prompt*>(data);
  const int64_t D = p.head_size, G = p.heads / p.kv_heads, S = p.tokens, N = p.heads;
  const auto [b, kvh, first, count, keys] = query_block(p, index);
  const int64_t stride = (keys + 31) / 32 * 32;
  const int64_t rows = count * G;
  scores.resize(static_cast<size_t>(rows * stride));
  queries.resize(static_cast<size_t>(rows));
  outs.resize(static_cast<size_t>(rows));
  inverses.resize(static_cast<size_t>(rows));
  for (int64_t s = 0; s < count; ++s)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = ((b * S + first + s) * N + kvh * G + g) * D;
      queries[s * G + g] = p.query + at;
      outs[s * G + g] = p.output + at;
    }
  const float* kt = p.keys_t + (b * p.kv_heads + kvh) * D * p.t_pad;
  if (kAvx512 && D % 16 == 0)
    scores_avx512(queries.data(), kt, p.t_pad, D, keys, p.scale, scores.data(), stride, rows);
  else
    scores_generic(queries.data(), kt, p.t_pad, D, keys, p.scale, scores.data(), stride, rows);
  int64_t from = keys;
  for (int64_t s = 0; s < count; ++s)
    for (int64_t g = 0; g < G; ++g)  // the inverse sums are applied to the weighted sums: one pass less over the scores
      from = std::min(from, row_softmax(p, b, kvh, first, s, g, keys, 1.0f, scores.data() + (s * G + g) * stride, inverses[s * G + g]));
  const float* values = p.values + (b * p.kv_heads + kvh) * p.values_stride * D;
  if (kAvx512 && D % 64 == 0)
    weighted_avx512(scores.data(), stride, from, keys, values, D, outs.data(), inverses.data(), rows);
  else
    weighted_generic(scores.data(), stride, from, keys, values, D, outs.data(), inverses.data(), rows);
}

// ---- several tokens a row on AMX tiles (the prompt session's nodes, ``tiles`` set) ----
// Scores: queries and keys each split into two bf16 parts (x = hi + lo, 16 significant bits together, an fp16 key
// exactly), three tile products (hi.hi + hi.lo + lo.hi) summed in fp32: the fp32 path's scores to about 2^-16. With
// one bf16 product (queries and keys rounded) a 512-token prompt's attention took 28 ms instead of 57, but SmolLM2-135M
// int8's top-1 moved by -0.14 to -0.44 points and its KL up to 3.5%: a score's error is the rounding times the norms.
// The softmax in fp32; the weighted sums the same way, weights and values split (with them rounded to bf16 once, the
// served mean KL rose 0.5-3.5%: a weight's error is its own). Keys and values are laid out once a call in the tiles'
// pair layout: keys [2 (hi, lo), D/2, T_pad, 2] (a B tile: 16 pairs of D x 16 keys), values [2 (hi, lo), T_pad/2, D, 2].

struct TilePrompt {
  const float* query;      // [B, S, N*D]
  float* output;
  const uint16_t* keys;    // [B, Nkv, 2, D/2, T_pad, 2]: hi, then lo
  const uint16_t* values;  // [B, Nkv, 2, T_pad/2, D, 2]: hi, then lo
  const int32_t* seqlens;
  const float* bias;
  int64_t bias_b, bias_h, bias_s, bias_t;
  int64_t tokens, heads, kv_heads, head_size, window, t_pad, blocks;
  float scale;
};

// One row's KV head's keys and values, up to its last, in the tiles' pair layout (zero past the last).
struct TileLayout {
  CacheView keys, values;
  uint16_t* keys_out;
  uint16_t* values_out;
  const int32_t* seqlens;
  Layout layout;
  int64_t t_pad;
};

// 16 floats to bf16, rounded to nearest even (as PromptMatMul rounds its input)
__attribute__((target("avx512f,avx512bf16"), always_inline)) inline __m256i bf16x16(const float* in) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in));
}

// 16 floats as two bf16 parts: hi their rounding, lo the rounding of what is left
__attribute__((target("avx512f,avx512bf16"), always_inline)) inline void split16(const float* in, uint16_t* hi, uint16_t* lo) {
  const __m512 x = _mm512_loadu_ps(in);
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), h);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, back)));
}

__attribute__((target("avx512f,avx512bf16"))) void tile_layout_task(void* data, size_t index) {
  thread_local std::vector<float> buffer;
  thread_local std::vector<uint16_t> run;  // 16 keys' (or values') bf16 rows
  const TileLayout& p = *static_cast<const TileLayout*>(data);
  const auto i = static_cast<int64_t>(index);
  const int64_t b = i / p.layout.kv_heads, h = i % p.layout.kv_heads, D = p.layout.head_size, pairs = D / 2;
  const int64_t keys = static_cast<int64_t>(p.seqlens[b]) + 1;
  uint16_t* kt = p.keys_out + i * 2 * D * p.t_pad;
  uint16_t* vt = p.values_out + i * 2 * D * p.t_pad;
  std::fill(kt, kt + 2 * D * p.t_pad, uint16_t{0});
  std::fill(vt, vt + 2 * D * p.t_pad, uint16_t{0});
  buffer.resize(static_cast<size_t>(D));
  run.resize(static_cast<size_t>(4 * 16 * D));
  uint16_t* krun = run.data();  // hi, then lo
  uint16_t* vrun = run.data() + 32 * D;  // hi, then lo
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(static_cast<int>(pairs)));
  for (int64_t t0 = 0; t0 < keys; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, keys - t0);
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= n) {
        std::fill(krun + j * D, krun + (j + 1) * D, uint16_t{0});
        std::fill(krun + (16 + j) * D, krun + (17 + j) * D, uint16_t{0});
        std::fill(vrun + j * D, vrun + (j + 1) * D, uint16_t{0});
        std::fill(vrun + (16 + j) * D, vrun + (17 + j) * D, uint16_t{0});
        continue;
      }
      const int64_t at = p.layout.at(b, h, t0 + j);
      const float* k = p.keys.values(at, D, buffer.data());
      for (int64_t d = 0; d < D; d += 16) split16(k + d, krun + j * D + d, krun + (16 + j) * D + d);
      const float* v = p.values.values(at, D, buffer.data());
      for (int64_t d = 0; d < D; d += 16) split16(v + d, vrun + j * D + d, vrun + (16 + j) * D + d);
    }
    // keys [D/2, T_pad, 2]: pair q of the 16 keys, one 64-byte row each
    for (int64_t part = 0; part < 2; ++part) {
      const int* words = reinterpret_cast<const int*>(krun + part * 16 * D);
      for (int64_t q = 0; q < pairs; ++q)
        _mm512_storeu_si512(kt + part * D * p.t_pad + (q * p.t_pad + t0) * 2,
                            _mm512_i32gather_epi32(_mm512_add_epi32(rows, _mm512_set1_epi32(static_cast<int>(q))), words, 4));
    }
    // values [2 (hi, lo), T_pad/2, D, 2]: keys t and t + 1 interleaved
    for (int64_t part = 0; part < 2; ++part)
      for (int64_t j = 0; j < 16; j += 2)
        for (int64_t d = 0; d < D; d += 16) {
          const uint16_t* from = vrun + part * 16 * D;
          const __m512i first = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + j * D + d)));
          const __m512i second = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + (j + 1) * D + d)));
          _mm512_storeu_si512(vt + part * D * p.t_pad + (((t0 + j) / 2) * D + d) * 2, _mm512_or_si512(first, _mm512_slli_epi32(second, 16)));
        }
  }
}

// The tiles' softmax (their scores unscaled), out of line: inlined into the tiles' task its exponentials ran one at a
// time (58 of a 512-token prompt's 73 ms); here target_clones vectorizes them.
__attribute__((target_clones("avx512f", "avx2", "default"))) void tile_softmax(const TilePrompt& p, int64_t b, int64_t kvh, int64_t first,
                                                                             int64_t s, int64_t g, int64_t stride, float* row, float& inverse) {
  row_softmax(p, b, kvh, first, s, g, stride, p.scale, row, inverse);
}

// C tile ``C`` += the queries' parts in tmm4 (hi) and tmm5 (lo) times 16 keys' parts at ``hi`` and ``lo``: hi.hi + hi.lo +
// lo.hi. A macro: GCC's tile intrinsics paste their register numbers into the assembly, so they take literals only.
#define KVEXPORT_SPLIT_SCORES(C, hi, lo, pitch) \
  do {                                          \
    _tile_loadd(6, hi, pitch);                  \
    _tile_loadd(7, lo, pitch);                  \
    _tile_dpbf16ps(C, 4, 6);                    \
    _tile_dpbf16ps(C, 4, 7);                    \
    _tile_dpbf16ps(C, 5, 6);                    \
  } while (0)

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void tile_prompt_task(void* data, size_t index) {
  thread_local std::vector<float> scores;
  thread_local std::vector<uint16_t> q16, w16;
  thread_local std::vector<float> inverses;
  const TilePrompt& p = *static_cast<const TilePrompt*>(data);
  const int64_t D = p.head_size, G = p.heads / p.kv_heads, S = p.tokens, N = p.heads;
  const auto [b, kvh, first, count, keys] = query_block(p, index);
  const int64_t stride = (keys + 31) / 32 * 32;  // whole 32-key steps of the weighted sum
  const int64_t rows = count * G, groups = (rows + 15) / 16;
  scores.resize(static_cast<size_t>(groups * 16 * stride));
  q16.assign(static_cast<size_t>(2 * groups * 16 * D), 0);  // hi, then lo
  uint16_t* q_lo = q16.data() + groups * 16 * D;
  w16.resize(static_cast<size_t>(2 * groups * 16 * stride));  // hi, then lo
  uint16_t* w_lo = w16.data() + groups * 16 * stride;
  inverses.resize(static_cast<size_t>(groups * 16));
  for (int64_t s = 0; s < count; ++s)  // rows: the block's queries x the group's heads
    for (int64_t g = 0; g < G; ++g) {
      const float* q = p.query + ((b * S + first + s) * N + kvh * G + g) * D;
      for (int64_t d = 0; d < D; d += 16) split16(q + d, q16.data() + (s * G + g) * D + d, q_lo + (s * G + g) * D + d);
    }
  kvexport_configure_tiles();  // tmm0-3: C (16 x 16 fp32); tmm4-5: A (16 x 32 bf16); tmm6-7: B (16 pairs x 16 x 2)
  const uint16_t* kt = p.keys + (b * p.kv_heads + kvh) * 2 * D * p.t_pad;
  const uint16_t* kt_lo = kt + D * p.t_pad;
  for (int64_t rg = 0; rg < groups; ++rg)  // scores: 16 rows x 64 keys (4 C tiles), D in steps of 32
    for (int64_t k0 = 0; k0 < stride; k0 += 64) {
      const int64_t width = std::min<int64_t>(4, (stride - k0) / 16);  // stride: whole 32s, so 2 or 4
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d0 = 0; d0 < D; d0 += 32) {  // hi.hi + hi.lo + lo.hi
        _tile_loadd(4, q16.data() + rg * 16 * D + d0, D * 2);
        _tile_loadd(5, q_lo + rg * 16 * D + d0, D * 2);
        const int64_t at = ((d0 / 2) * p.t_pad + k0) * 2, pitch = p.t_pad * 4;
        KVEXPORT_SPLIT_SCORES(0, kt + at, kt_lo + at, pitch);
        KVEXPORT_SPLIT_SCORES(1, kt + at + 32, kt_lo + at + 32, pitch);
        if (width > 2) {
          KVEXPORT_SPLIT_SCORES(2, kt + at + 64, kt_lo + at + 64, pitch);
          KVEXPORT_SPLIT_SCORES(3, kt + at + 96, kt_lo + at + 96, pitch);
        }
      }
      float* out = scores.data() + rg * 16 * stride + k0;
      _tile_stored(0, out, stride * 4);
      _tile_stored(1, out + 16, stride * 4);
      if (width > 2) {
        _tile_stored(2, out + 32, stride * 4);
        _tile_stored(3, out + 48, stride * 4);
      }
    }
  for (int64_t s = 0; s < count; ++s)
    for (int64_t g = 0; g < G; ++g) {
      float* row = scores.data() + (s * G + g) * stride;
      tile_softmax(p, b, kvh, first, s, g, stride, row, inverses[s * G + g]);
      for (int64_t t = 0; t < stride; t += 16) split16(row + t, w16.data() + (s * G + g) * stride + t, w_lo + (s * G + g) * stride + t);
    }
  for (int64_t r = rows; r < groups * 16; ++r) {
    std::fill(w16.begin() + r * stride, w16.begin() + (r + 1) * stride, uint16_t{0});
    std::fill(w_lo + r * stride, w_lo + (r + 1) * stride, uint16_t{0});
  }
  const uint16_t* vt = p.values + (b * p.kv_heads + kvh) * 2 * D * p.t_pad;
  const uint16_t* vt_lo = vt + D * p.t_pad;
  alignas(64) float tile[16 * 16];
  for (int64_t rg = 0; rg < groups; ++rg)  // weighted sums: 16 rows x 64 values (4 C tiles), keys in steps of 32
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
      const int64_t width = std::min<int64_t>(4, (D - c0) / 16);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t t0 = 0; t0 < stride; t0 += 32) {  // hi.hi + hi.lo + lo.hi, as the scores
        _tile_loadd(4, w16.data() + rg * 16 * stride + t0, stride * 2);
        _tile_loadd(5, w_lo + rg * 16 * stride + t0, stride * 2);
        const int64_t at = ((t0 / 2) * D + c0) * 2;
        KVEXPORT_SPLIT_SCORES(0, vt + at, vt_lo + at, D * 4);
        KVEXPORT_SPLIT_SCORES(1, vt + at + 32, vt_lo + at + 32, D * 4);  // width >= 2: D is a multiple of 32
        if (width > 2) {
          KVEXPORT_SPLIT_SCORES(2, vt + at + 64, vt_lo + at + 64, D * 4);
          KVEXPORT_SPLIT_SCORES(3, vt + at + 96, vt_lo + at + 96, D * 4);
        }
      }
      for (int64_t c = 0; c < width; ++c) {
        switch (c) {
          case 0: _tile_stored(0, tile, 64); break;
          case 1: _tile_stored(1, tile, 64); break;
          case 2: _tile_stored(2, tile, 64); break;
          default: _tile_stored(3, tile, 64); break;
        }
        for (int64_t r = 0; r < 16 && rg * 16 + r < rows; ++r) {
          const int64_t row = rg * 16 + r, s = row / G, g = row % G;
          float* out = p.output + ((b * S + first + s) * N + kvh * G + g) * D + c0 + 16 * c;
          const __m512 inverse = _mm512_set1_ps(inverses[row]);
          _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_load_ps(tile + 16 * r), inverse));
        }
      }
    }
  _tile_release();
}

struct Transpose {
  CacheView keys;    // present
  CacheView values;  // present; gathered into values_out where that is set (paged, or fp16)
  float* keys_t;     // [B, Nkv, D, T_pad]
  float* values_out;  // null, or [B, Nkv, T_pad, D]
  const int32_t* seqlens;
  Layout layout;
  int64_t t_pad;
};

void transpose_task(void* data, size_t index) {
  thread_local std::vector<float> buffer;
  const Transpose& p = *static_cast<const Transpose*>(data);
  const auto i = static_cast<int64_t>(index);
  const int64_t kv_heads = p.layout.kv_heads, b = i / kv_heads, h = i % kv_heads, D = p.layout.head_size;
  const int64_t keys = static_cast<int64_t>(p.seqlens[b]) + 1;
  float* to = p.keys_t + i * D * p.t_pad;
  const float* from[16];
  buffer.resize(static_cast<size_t>(16 * D));
  for (int64_t t0 = 0; t0 < keys; t0 += 16) {  // 16 keys at a time: the reads stay in a few lines
    const int64_t n = std::min<int64_t>(16, keys - t0);
    for (int64_t t = 0; t < n; ++t) from[t] = p.keys.values(p.layout.at(b, h, t0 + t), D, buffer.data() + t * D);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = 0; t < n; ++t) to[d * p.t_pad + t0 + t] = from[t][d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(to + d * p.t_pad + keys, to + (d + 1) * p.t_pad, 0.0f);
  if (p.values_out == nullptr) return;
  float* values = p.values_out + i * p.t_pad * D;
  for (int64_t t = 0; t < keys; ++t) {
    const float* from_cache = p.values.values(p.layout.at(b, h, t), D, values + t * D);
    if (from_cache != values + t * D) std::memcpy(values + t * D, from_cache, static_cast<size_t>(D) * sizeof(float));
  }
}

struct CacheAttentionKernel {
  int64_t heads, kv_heads, window;
  float scale;
  bool tiles = false;  // prompts (several tokens a row) on AMX tiles in bf16: the prompt session's nodes (attribute bf16_tiles)

  CacheAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info(info);
    try {
      tiles = kernel_info.GetAttribute<int64_t>("bf16_tiles") != 0 && kTiles;  // kTiles: only where AMX is allowed
    } catch (const Ort::Exception&) {  // absent: fp32
    }
    heads = kernel_info.GetAttribute<int64_t>("num_heads");
    kv_heads = kernel_info.GetAttribute<int64_t>("kv_num_heads");
    scale = kernel_info.GetAttribute<float>("scale");
    window = kernel_info.GetAttribute<int64_t>("local_window_size");
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
      throw std::invalid_argument("CacheAttention: num_heads must be a positive multiple of kv_num_heads");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    auto query = context.GetInput(0), key = context.GetInput(1), value = context.GetInput(2);
    auto past_key = context.GetInput(3), past_value = context.GetInput(4), seqlens = context.GetInput(5);
    const auto q_shape = query.GetTensorTypeAndShapeInfo().GetShape();
    const auto cache_shape = past_key.GetTensorTypeAndShapeInfo().GetShape();
    if (q_shape.size() != 3 || cache_shape.size() != 4)
      throw std::invalid_argument("CacheAttention: queries [B, S, N*D] over a [B, Nkv, C, D] cache");
    const auto element_type = past_key.GetTensorTypeAndShapeInfo().GetElementType();
    const Kind kind = element_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8      ? Kind::kQ8
                      : element_type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? Kind::kF16
                                                                              : Kind::kF32;
    // a q8 position: D codes and the scale's 4 bytes
    const int64_t B = q_shape[0], S = q_shape[1], D = cache_shape[3] - (kind == Kind::kQ8 ? kScaleBytes : 0);
    if (S < 1 || D < 1)
      throw std::invalid_argument("CacheAttention: a call needs at least one token and a head size");
    const Layout layout = layout_of(context, B, cache_shape, D);
    if (kind == Kind::kQ8 && layout.table == nullptr)
      throw std::invalid_argument("CacheAttention: an 8-bit cache with a scale a position is a paged pool's only (give block_table)");
    const int64_t C = layout.table == nullptr ? cache_shape[2] : layout.width * layout.block_size;  // a row's positions
    const bool rows_fit = layout.table == nullptr ? cache_shape[0] == B && cache_shape[1] == kv_heads : cache_shape[0] == kv_heads;
    if (q_shape[2] != heads * D || !rows_fit)
      throw std::invalid_argument("CacheAttention: the query's and the cache's shapes disagree with the heads");
    const std::vector<int64_t> kv_shape{B, S, kv_heads * D};
    if (key.GetTensorTypeAndShapeInfo().GetShape() != kv_shape || value.GetTensorTypeAndShapeInfo().GetShape() != kv_shape)
      throw std::invalid_argument("CacheAttention: key and value must be [B, S, Nkv*D] as the query and the cache say");
    if (past_value.GetTensorTypeAndShapeInfo().GetShape() != cache_shape)
      throw std::invalid_argument("CacheAttention: past_value's shape differs from past_key's");
    if (seqlens.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(B))
      throw std::invalid_argument("CacheAttention: seqlens_k must hold one length per row");
    const int32_t* lengths = seqlens.GetTensorData<int32_t>();
    int64_t longest = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t keys = static_cast<int64_t>(lengths[b]) + 1;
      const int64_t past = std::max<int64_t>(0, keys - S);
      if (keys < 1 || past + S > C)
        throw std::out_of_range("CacheAttention: seqlens_k " + std::to_string(lengths[b]) + " puts the call's tokens outside the cache's " +
                                std::to_string(C) + " positions");
      if (layout.table != nullptr)
        for (int64_t block = 0; block * layout.block_size < keys; ++block) {
          const int32_t at = layout.table[b * layout.width + block];
          if (at < 0 || at >= layout.blocks)
            throw std::out_of_range("CacheAttention: block_table names block " + std::to_string(at) + ", outside the pool's " +
                                    std::to_string(layout.blocks));
        }
      longest = std::max<int64_t>(longest, keys);
    }

    auto output = context.GetOutput(0, q_shape);
    auto present_key = context.GetOutput(1, cache_shape);
    auto present_value = context.GetOutput(2, cache_shape);
    const auto element = static_cast<size_t>(element_bytes(kind));
    void* pk = present_key.GetTensorMutableRawData();
    void* pv = present_value.GetTensorMutableRawData();
    const size_t cache_bytes = static_cast<size_t>(cache_shape[0] * cache_shape[1] * cache_shape[2] * cache_shape[3]) * element;
    if (pk != past_key.GetTensorRawData()) std::memcpy(pk, past_key.GetTensorRawData(), cache_bytes);
    if (pv != past_value.GetTensorRawData()) std::memcpy(pv, past_value.GetTensorRawData(), cache_bytes);
    const auto view = [&](void* cache) {
      CacheView out{nullptr, nullptr, nullptr, D, layout.row};
      if (kind == Kind::kQ8)
        out.q8 = static_cast<const int8_t*>(cache);
      else if (kind == Kind::kF16)
        out.f16 = static_cast<const uint16_t*>(cache);
      else
        out.f32 = static_cast<const float*>(cache);
      return out;
    };
    const CacheView keys = view(pk), values = view(pv);
    const float* k = key.GetTensorData<float>();
    const float* v = value.GetTensorData<float>();
    for (int64_t b = 0; b < B; ++b) {  // the call's rows after each row's past: where the op writes them
      const int64_t past = std::max<int64_t>(0, static_cast<int64_t>(lengths[b]) + 1 - S);
      for (int64_t s = 0; s < S; ++s)
        for (int64_t h = 0; h < kv_heads; ++h) {
          const int64_t at = layout.at(b, h, past + s), from = ((b * S + s) * kv_heads + h) * D;
          if (kind == Kind::kQ8) {
            to_q8(k + from, static_cast<int8_t*>(pk) + at, D);
            to_q8(v + from, static_cast<int8_t*>(pv) + at, D);
          } else if (kind == Kind::kF16) {
            to_half(k + from, static_cast<uint16_t*>(pk) + at, D);
            to_half(v + from, static_cast<uint16_t*>(pv) + at, D);
          } else {
            std::memcpy(static_cast<float*>(pk) + at, k + from, static_cast<size_t>(D) * sizeof(float));
            std::memcpy(static_cast<float*>(pv) + at, v + from, static_cast<size_t>(D) * sizeof(float));
          }
        }
    }
    const float used_scale = scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(D));
    std::vector<int64_t> bias_shape{1, 1, 1, 0};
    const float* bias_data = bias_of(context, B, S, longest, bias_shape);
    if (S > 1 && tiles && D % 32 == 0 && D <= 256) {
      const int64_t t_pad = (longest + 31) / 32 * 32;
      std::vector<uint16_t> keys_t(static_cast<size_t>(2 * B * kv_heads * D * t_pad)), values_t(keys_t.size());
      TileLayout tile_layout{keys, values, keys_t.data(), values_t.data(), lengths, layout, t_pad};
      context.ParallelFor(tile_layout_task, static_cast<size_t>(B * kv_heads), 0, &tile_layout);
      const int64_t blocks = (S + kQueryBlock - 1) / kQueryBlock;
      TilePrompt prompt{query.GetTensorData<float>(), output.GetTensorMutableData<float>(), keys_t.data(), values_t.data(), lengths,
                        bias_data, bias_shape[0], bias_shape[1], bias_shape[2], bias_shape[3],
                        S, heads, kv_heads, D, window, t_pad, blocks, used_scale};
      context.ParallelFor(tile_prompt_task, static_cast<size_t>(B * kv_heads * blocks), 0, &prompt);
      return;
    }
    if (S > 1) {
      const int64_t t_pad = (longest + 31) / 32 * 32;
      const bool gather = layout.table != nullptr || kind != Kind::kF32;  // a paged or converted cache's values, row by row in fp32
      std::vector<float> keys_t(static_cast<size_t>(B * kv_heads * D * t_pad));
      std::vector<float> gathered(gather ? keys_t.size() : 0);
      Transpose transpose{keys, values, keys_t.data(), gather ? gathered.data() : nullptr, lengths, layout, t_pad};
      context.ParallelFor(transpose_task, static_cast<size_t>(B * kv_heads), 0, &transpose);
      const int64_t blocks = (S + kQueryBlock - 1) / kQueryBlock;
      Prompt prompt{query.GetTensorData<float>(), output.GetTensorMutableData<float>(), keys_t.data(),
                    gather ? gathered.data() : values.f32, lengths,
                    bias_data, bias_shape[0], bias_shape[1], bias_shape[2], bias_shape[3],
                    S, heads, kv_heads, D, gather ? t_pad : C, window, t_pad, blocks, used_scale};
      context.ParallelFor(prompt_task, static_cast<size_t>(B * kv_heads * blocks), 0, &prompt);
      return;
    }
    Problem problem{query.GetTensorData<float>(), output.GetTensorMutableData<float>(), keys, values, lengths,
                    bias_data, bias_shape[0], bias_shape[1], bias_shape[3], heads, kv_heads, D, window, layout, used_scale};
    context.ParallelFor(attend_task, static_cast<size_t>(B * kv_heads), 0, &problem);
  }

  // the row layout, or (a block_table given) the paged one
  Layout layout_of(Ort::KernelContext& context, int64_t B, const std::vector<int64_t>& cache_shape, int64_t D) const {
    Layout layout{nullptr, 1, cache_shape[2], kv_heads, D, 0, cache_shape[3]};
    if (context.GetInputCount() <= 7) return layout;
    auto table = context.GetInput(7);
    if (table == nullptr) return layout;
    const auto shape = table.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 2 || shape[0] != B || shape[1] < 1)
      throw std::invalid_argument("CacheAttention: block_table must be [B, W], a row of block numbers per query row");
    layout.table = table.GetTensorData<int32_t>();
    layout.width = shape[1];
    layout.blocks = cache_shape[1];
    return layout;
  }

  // the optional bias's data (null: none) and its shape in ``shape``
  const float* bias_of(Ort::KernelContext& context, int64_t B, int64_t S, int64_t longest, std::vector<int64_t>& shape) const {
    if (context.GetInputCount() <= 6) return nullptr;
    auto bias = context.GetInput(6);
    if (bias == nullptr) return nullptr;
    shape = bias.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.size() != 4 || (shape[0] != 1 && shape[0] != B) || (shape[1] != 1 && shape[1] != heads) || (shape[2] != 1 && shape[2] != S))
      throw std::invalid_argument("CacheAttention: attention_bias must be [B or 1, N or 1, S or 1, T]");
    if (longest > shape[3]) throw std::out_of_range("CacheAttention: attention_bias is narrower than a row's positions");
    return bias.GetTensorData<float>();
  }
};

// The op over an fp32 cache, or (``cache`` FLOAT16) an fp16 one, or (INT8) a q8 pool: past and present in that type,
// all else fp32.
template <ONNXTensorElementDataType cache>
struct CacheAttentionOp : Ort::CustomOpBase<CacheAttentionOp<cache>, CacheAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new CacheAttentionKernel(api, info); }
  const char* GetName() const { return "CacheAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    if (index == 5 || index == 7) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    return index == 3 || index == 4 ? cache : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index >= 6 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t index) const { return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : cache; }
};

}  // namespace

void add_prompt_matmul(Ort::CustomOpDomain& domain);  // prompt_matmul.cc

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  static CacheAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> op;
  static CacheAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> half_op;
  static CacheAttentionOp<ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8> q8_op;
  static std::once_flag initialized;
  std::call_once(initialized, [api_base] { Ort::InitApi(api_base->GetApi(ORT_API_VERSION)); });
  try {
    static Ort::CustomOpDomain domain{"kvexport"};
    static std::once_flag added;
    choose_paths();
    std::call_once(added, [] {
      domain.Add(&op);
      domain.Add(&half_op);
      domain.Add(&q8_op);
      add_prompt_matmul(domain);
    });
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const std::exception& error) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, error.what());
  }
  return nullptr;
}
