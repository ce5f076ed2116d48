// kvexport's prompt product for ONNX Runtime: Y = A @ W with W in bf16, on the CPU's bf16 units.
//
// The op `kvexport.PromptMatMul`:
//   inputs  A [..., K] float, W [N/16 (rounded up), K/2 (rounded up to 16), 16, 2] bf16: W's columns in groups of
//           16, each group's rows in pairs (the "VNNI" layout both AMX tiles and AVX512-BF16's dot products read),
//           zero past K and N; bias [N] float (optional)
//   outputs Y [..., N] float, or with `splits` one output a width: Y_i [..., splits[i]] (columns in order)
//   attributes K, N; splits (optional ints, summing to N, each but the last a multiple of 16: the projections that read
//           the same rows, e.g. a layer's query, key and value, as one product); gated (optional 0/1: W holds
//           2 * ceil(N/16) groups, a gate's and an up projection's 16 columns alternating, and Y = silu(A @ Wg) * (A @ Wu),
//           the SwiGLU MLP's first half in one pass over A, its activation applied as the tiles are stored; no bias)
// A is rounded to bf16 (round to nearest even); the sums are fp32. Where the weight came from int8 blocks
// (llama.cpp's Q8_0 grid) the bf16 value is the block's code times its scale rounded to 8 significant bits.
//
// Why: prompts are GEMM work. ONNX Runtime 1.31.1's MatMulNBits (the int8 blocks at accuracy level 4) runs
// them at ~0.24 TFLOP/s on 2 Sapphire Rapids cores, where the same cores' AMX tiles do ~2 TFLOP/s in bf16
// (benchmarks/roofline.py measures both). Decode (one row) stays on MatMulNBits: it is bandwidth-bound, and
// the int8 blocks are half the bytes.
//
// The path is picked when the kernel is made, from the CPU (KVEXPORT_PROMPT_GEMM=amx|avx512bf16|generic
// forces one; a path the CPU lacks is refused): AMX tiles where the CPU and the OS allow them, else a portable
// loop (correct, not fast: the runtime opens no prompt session there). AVX512-BF16 dot products run by name only.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

void kvexport_configure_tiles();  // below: every tile 16 rows of 64 bytes (both kernels' only shape)

namespace {

constexpr int64_t kGroup = 16;  // W's columns a group; a tile's and a zmm's fp32 columns
constexpr int64_t kStep = 32;   // K a tile step (16 pairs)
constexpr int64_t kRows = 32;   // A rows a block (two tiles of 16)

enum class Path { kAmx, kAvx512Bf16, kGeneric };

const char* path_name(Path path) {
  return path == Path::kAmx ? "amx" : path == Path::kAvx512Bf16 ? "avx512bf16" : "generic";
}

// Linux hands a process AMX's tile data only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_allowed() {
  static const bool allowed = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return allowed;
}

bool has_avx512bf16() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f"); }

Path pick_path() {
  const char* forced = std::getenv("KVEXPORT_PROMPT_GEMM");
  const std::string choice = forced != nullptr ? forced : "";
  if (choice == "generic") return Path::kGeneric;
  if (choice == "avx512bf16") {
    if (!has_avx512bf16()) throw std::runtime_error("PromptMatMul: KVEXPORT_PROMPT_GEMM=avx512bf16 but this CPU has no AVX512-BF16");
    return Path::kAvx512Bf16;
  }
  if (choice == "amx") {
    if (!amx_allowed()) throw std::runtime_error("PromptMatMul: KVEXPORT_PROMPT_GEMM=amx but this CPU (or the OS) gives no AMX tiles");
    return Path::kAmx;
  }
  if (!choice.empty() && choice != "auto")
    throw std::runtime_error("PromptMatMul: KVEXPORT_PROMPT_GEMM=" + choice + " is not amx, avx512bf16, generic or auto");
  // auto takes AMX only: AVX512-BF16's dot products ran SmolLM2's products at ~200 GFLOP/s on 2 Sapphire Rapids cores,
  // below ONNX Runtime's int8 blocks (~250) there; asked for by name, it runs (to measure it on another host)
  if (amx_allowed()) return Path::kAmx;
  return Path::kGeneric;
}

inline uint16_t to_bf16(float value) {  // round to nearest even (no NaNs come here: activations are finite)
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t value) {
  const uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

constexpr int64_t kMaxOutputs = 8;

struct Output {
  float* y;                // [M, width]
  int64_t begin, width;    // its columns among the product's
};

struct Product {
  const uint16_t* a;  // [M_pad, K_pad] bf16, zero past M and K
  const uint16_t* w;  // [groups, K_pad/2, 16, 2]
  const float* bias;  // null or [N]
  Output outs[kMaxOutputs];
  int64_t n_outs;
  bool gated;         // pair p of groups (gate, up) gives the output's columns 16p .. 16p + 15 (outs[0] only)
  int64_t m, n, k_pad, groups, m_blocks;  // n: the product's columns (gated: the output's)
};

// The output that holds the product's column `col` (each output's columns start at a multiple of 16).
inline const Output& output_of(const Product& p, int64_t col) {
  int64_t i = 0;
  while (i + 1 < p.n_outs && col >= p.outs[i + 1].begin) ++i;
  return p.outs[i];
}

// silu(gate) * up for `rows` rows of `cols` (<= 16) columns: gate and up rows `in_ld` apart, out's `ld` apart.
__attribute__((target_clones("avx512f", "avx2", "default"))) void swiglu_rows(const float* gate, const float* up, int64_t in_ld,
                                                                               float* out, int64_t ld, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gate + r * in_ld;
    const float* u = up + r * in_ld;
    float* y = out + r * ld;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) y[c] = g[c] / (1.0f + std::exp(-g[c])) * u[c];
  }
}

// The rows' A in bf16, padded with zeros to whole blocks and steps.
struct Convert {
  const float* a;
  uint16_t* out;
  int64_t m, k, k_pad;
};

const bool kHasAvx512Bf16 = has_avx512bf16();

// 16 values at a time (the same rounding as to_bf16); returns how many it converted.
__attribute__((target("avx512f,avx512bf16"))) int64_t convert_avx512bf16(const float* in, uint16_t* out, int64_t count) {
  int64_t i = 0;
  for (; i + 16 <= count; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
  return i;
}

void convert_task(void* data, size_t index) {
  const Convert& c = *static_cast<const Convert*>(data);
  const auto row = static_cast<int64_t>(index);
  uint16_t* out = c.out + row * c.k_pad;
  if (row >= c.m) {
    std::fill(out, out + c.k_pad, uint16_t{0});
    return;
  }
  const float* in = c.a + row * c.k;
  int64_t i = kHasAvx512Bf16 ? convert_avx512bf16(in, out, c.k) : 0;
  for (; i < c.k; ++i) out[i] = to_bf16(in[i]);
  std::fill(out + c.k, out + c.k_pad, uint16_t{0});
}

// Y's block (rows, 16 columns) from a [rows, 16] fp32 tile, with the bias, only the valid rows and columns.
inline void store_block(const Product& p, const float* tile, int64_t row0, int64_t rows, int64_t col0) {
  const Output& out = output_of(p, col0);
  const int64_t valid_rows = std::min<int64_t>(rows, p.m - row0);
  const int64_t cols = std::min<int64_t>(kGroup, out.begin + out.width - col0);
  for (int64_t r = 0; r < valid_rows; ++r) {
    float* y = out.y + (row0 + r) * out.width + (col0 - out.begin);
    const float* t = tile + r * kGroup;
    if (p.bias != nullptr)
      for (int64_t c = 0; c < cols; ++c) y[c] = t[c] + p.bias[col0 + c];
    else
      std::memcpy(y, t, static_cast<size_t>(cols) * sizeof(float));
  }
}

// ---- AMX: a task takes a chunk of rows and columns, 32 x 32 at a time (4 accumulator tiles) ----
constexpr int64_t kChunkBlocks = 4;  // 32-row blocks a task: A's chunk stays in L2 across the task's columns
constexpr int64_t kChunkPairs = 4;   // 32-column pairs of groups a task: each pair's W stays in L1/L2 across its rows

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tile t of the 32 x 32 block at (row0, col0) into Y: straight where it is whole and has no bias, else through a copy.
__attribute__((target("amx-tile,avx512f"))) inline void store_tile(const Product& p, int t, int64_t row0, int64_t col0, float* tile) {
  const Output& out = output_of(p, col0);
  if (row0 + 16 <= p.m && col0 + kGroup <= out.begin + out.width && p.bias == nullptr) {
    float* y = out.y + row0 * out.width + (col0 - out.begin);
    const int64_t stride = out.width * 4;
    switch (t) {
      case 0: _tile_stored(0, y, stride); break;
      case 1: _tile_stored(1, y, stride); break;
      case 2: _tile_stored(2, y, stride); break;
      default: _tile_stored(3, y, stride); break;
    }
    return;
  }
  if (row0 >= p.m || col0 >= p.n) return;
  switch (t) {
    case 0: _tile_stored(0, tile, 64); break;
    case 1: _tile_stored(1, tile, 64); break;
    case 2: _tile_stored(2, tile, 64); break;
    default: _tile_stored(3, tile, 64); break;
  }
  store_block(p, tile, row0, 16, col0);
}

// Gated: tiles 0 and 1 (2 and 3) are the gate's and the up projection's 16 columns of the block's first (second) 16
// rows; their silu(gate) * up goes to the output's columns 16 * pair.
__attribute__((target("amx-tile,avx512f"))) inline void store_gated(const Product& p, int64_t row0, int64_t pair, float* tiles) {
  const int64_t col0 = pair * kGroup, cols = std::min<int64_t>(kGroup, p.n - col0);
  float* gate = tiles;
  float* up = tiles + kGroup * kGroup;
  const Output& out = p.outs[0];
  for (int half = 0; half < 2; ++half) {
    const int64_t row = row0 + half * 16;
    if (row >= p.m) return;
    if (half == 0) {
      _tile_stored(0, gate, 64);
      _tile_stored(1, up, 64);
    } else {
      _tile_stored(2, gate, 64);
      _tile_stored(3, up, 64);
    }
    swiglu_rows(gate, up, kGroup, out.y + row * out.width + col0, out.width, std::min<int64_t>(16, p.m - row), cols);
  }
}

__attribute__((target("amx-tile,amx-bf16,avx512f"))) void amx_task(void* data, size_t index) {
  const Product& p = *static_cast<const Product*>(data);
  kvexport_configure_tiles();  // tmm0-3: C (16 x 16 fp32); tmm4-5: A (16 x 32 bf16); tmm6-7: W (16 pairs x 16 x 2)
  alignas(64) float tile[2 * kGroup * kGroup];
  const int64_t pairs_total = (p.groups + 1) / 2;
  const int64_t n_chunks = (pairs_total + kChunkPairs - 1) / kChunkPairs;
  const int64_t mc = static_cast<int64_t>(index) / n_chunks, nc = static_cast<int64_t>(index) % n_chunks;
  const int64_t a_stride = p.k_pad * 2, pairs = p.k_pad / 2;
  const int64_t mb_end = std::min<int64_t>(p.m_blocks, (mc + 1) * kChunkBlocks);
  const int64_t pair_end = std::min<int64_t>(pairs_total, (nc + 1) * kChunkPairs);
  for (int64_t pair = nc * kChunkPairs; pair < pair_end; ++pair) {
    const int64_t g0 = pair * 2;
    const uint16_t* w0 = p.w + g0 * pairs * 32;
    const uint16_t* w1 = g0 + 1 < p.groups ? w0 + pairs * 32 : w0;
    for (int64_t mb = mc * kChunkBlocks; mb < mb_end; ++mb) {
      const uint16_t* a0 = p.a + mb * kRows * p.k_pad;
      const uint16_t* a1 = a0 + 16 * p.k_pad;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k0 = 0; k0 < p.k_pad; k0 += kStep) {
        _tile_loadd(4, a0 + k0, a_stride);
        _tile_loadd(6, w0 + k0 * kGroup, 64);  // 16 pairs from pair k0/2: (k0/2) * 16 columns * 2
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w1 + k0 * kGroup, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + k0, a_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      const int64_t row0 = mb * kRows, col0 = g0 * kGroup;
      if (p.gated) {
        store_gated(p, row0, pair, tile);
        continue;
      }
      store_tile(p, 0, row0, col0, tile);
      store_tile(p, 1, row0, col0 + kGroup, tile);
      store_tile(p, 2, row0 + 16, col0, tile);
      store_tile(p, 3, row0 + 16, col0 + kGroup, tile);
    }
  }
  _tile_release();
}

// ---- AVX512-BF16: 8 rows x 3 groups (24 accumulators) a block of registers; a task takes 3 groups, every row ----
constexpr int64_t kBf16Rows = 8, kBf16Groups = 3;

__attribute__((target("avx512f,avx512bf16"))) void avx512bf16_task(void* data, size_t index) {
  const Product& p = *static_cast<const Product*>(data);
  alignas(64) float tile[kGroup * kGroup];
  const int64_t g0 = static_cast<int64_t>(index) * kBf16Groups;
  const int64_t groups = std::min<int64_t>(kBf16Groups, p.groups - g0);
  const int64_t pairs = p.k_pad / 2;
  const uint16_t* w[kBf16Groups];
  for (int64_t g = 0; g < kBf16Groups; ++g) w[g] = p.w + (g0 + std::min<int64_t>(g, groups - 1)) * pairs * 32;
  const int64_t rows_total = std::min<int64_t>(p.m_blocks * kRows, (p.m + kBf16Rows - 1) / kBf16Rows * kBf16Rows);
  for (int64_t r0 = 0; r0 < rows_total; r0 += kBf16Rows) {
    __m512 acc[kBf16Rows][kBf16Groups];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    const uint32_t* a = reinterpret_cast<const uint32_t*>(p.a + r0 * p.k_pad);
    const int64_t a_pairs = p.k_pad / 2;
    for (int64_t kp = 0; kp < pairs; ++kp) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w[0] + kp * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w[1] + kp * 32);
      const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w[2] + kp * 32);
#pragma GCC unroll 8
      for (int i = 0; i < kBf16Rows; ++i) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * a_pairs + kp]));
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], x, w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], x, w1);
        acc[i][2] = _mm512_dpbf16_ps(acc[i][2], x, w2);
      }
    }
    for (int64_t g = 0; g < groups; ++g) {
      for (int i = 0; i < kBf16Rows; ++i) _mm512_store_ps(tile + i * kGroup, acc[i][g]);
      store_block(p, tile, r0, kBf16Rows, (g0 + g) * kGroup);
    }
  }
}

// ---- portable: bf16 widened to fp32, one group a task ----
void generic_task(void* data, size_t index) {
  const Product& p = *static_cast<const Product*>(data);
  const auto g = static_cast<int64_t>(index);
  const int64_t pairs = p.k_pad / 2;
  const uint16_t* w = p.w + g * pairs * 32;
  float tile[kGroup];
  for (int64_t r = 0; r < p.m; ++r) {
    const uint16_t* a = p.a + r * p.k_pad;
    std::fill(tile, tile + kGroup, 0.0f);
    for (int64_t kp = 0; kp < pairs; ++kp)
      for (int64_t c = 0; c < kGroup; ++c)
        tile[c] += from_bf16(a[2 * kp]) * from_bf16(w[(kp * kGroup + c) * 2]) +
                   from_bf16(a[2 * kp + 1]) * from_bf16(w[(kp * kGroup + c) * 2 + 1]);
    store_block(p, tile, r, 1, g * kGroup);
  }
}

// An optional attribute's value, or `fallback` where the node does not carry it.
template <class T>
T optional_attribute(const Ort::ConstKernelInfo& info, const char* name, T fallback) {
  try {
    return info.GetAttribute<T>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// The gated product's silu(gate) * up from the alternating groups the fallback paths computed into `full` [M, groups * 16].
void gate_rows(const float* full, int64_t groups, float* y, int64_t m, int64_t n) {
  const int64_t ld = groups * kGroup;
  for (int64_t pair = 0; pair < groups / 2; ++pair) {
    const int64_t col0 = pair * kGroup;
    swiglu_rows(full + 2 * col0, full + 2 * col0 + kGroup, ld, y + col0, n, m, std::min<int64_t>(kGroup, n - col0));
  }
}

struct PromptMatMulKernel {
  int64_t k, n;
  bool gated;
  std::vector<int64_t> splits;  // the outputs' widths
  Path path;

  PromptMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : path(pick_path()) {
    Ort::ConstKernelInfo kernel_info(info);
    k = kernel_info.GetAttribute<int64_t>("K");
    n = kernel_info.GetAttribute<int64_t>("N");
    if (k <= 0 || n <= 0) throw std::invalid_argument("PromptMatMul: K and N must be positive");
    gated = optional_attribute<int64_t>(kernel_info, "gated", 0) != 0;
    try {
      splits = kernel_info.GetAttributes<int64_t>("splits");
    } catch (const Ort::Exception&) {  // absent: one output
      splits = {n};
    }
    int64_t total = 0;
    for (size_t i = 0; i < splits.size(); ++i) {
      if (splits[i] <= 0 || (i + 1 < splits.size() && splits[i] % kGroup != 0))
        throw std::invalid_argument("PromptMatMul: splits must be positive, each but the last a multiple of 16");
      total += splits[i];
    }
    if (total != n) throw std::invalid_argument("PromptMatMul: splits must sum to N");
    if (static_cast<int64_t>(splits.size()) > kMaxOutputs) throw std::invalid_argument("PromptMatMul: at most 8 splits");
    if (gated && splits.size() > 1) throw std::invalid_argument("PromptMatMul: a gated product has one output");
    if (static_cast<int64_t>(kernel_info.GetOutputCount()) != static_cast<int64_t>(splits.size()))
      throw std::invalid_argument("PromptMatMul: one output a split");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    auto a = context.GetInput(0), w = context.GetInput(1);
    auto a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (a_shape.empty() || a_shape.back() != k)
      throw std::invalid_argument("PromptMatMul: A's last dimension must be K = " + std::to_string(k));
    const int64_t k_pad = (k + kStep - 1) / kStep * kStep, groups = (n + kGroup - 1) / kGroup * (gated ? 2 : 1);
    const std::vector<int64_t> w_shape{groups, k_pad / 2, kGroup, 2};
    if (w.GetTensorTypeAndShapeInfo().GetShape() != w_shape)
      throw std::invalid_argument(gated ? "PromptMatMul: a gated W must be [2 * N/16, K/2, 16, 2] (rounded up to whole groups and steps)"
                                        : "PromptMatMul: W must be [N/16, K/2, 16, 2] (rounded up to whole groups and steps)");
    const float* bias = nullptr;
    if (context.GetInputCount() > 2) {
      auto b = context.GetInput(2);
      if (b != nullptr) {
        if (gated) throw std::invalid_argument("PromptMatMul: a gated product takes no bias");
        if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n))
          throw std::invalid_argument("PromptMatMul: bias must hold N values");
        bias = b.GetTensorData<float>();
      }
    }
    int64_t m = 1;
    for (size_t i = 0; i + 1 < a_shape.size(); ++i) m *= a_shape[i];
    Product product{nullptr, static_cast<const uint16_t*>(w.GetTensorRawData()), bias, {}, static_cast<int64_t>(splits.size()),
                    gated && path == Path::kAmx, m, n, k_pad, groups, (m + kRows - 1) / kRows};
    int64_t begin = 0;
    for (size_t i = 0; i < splits.size(); ++i) {
      auto y_shape = a_shape;
      y_shape.back() = splits[i];
      product.outs[i] = Output{context.GetOutput(i, y_shape).GetTensorMutableData<float>(), begin, splits[i]};
      begin += splits[i];
    }
    if (m == 0) return;
    // 64-byte aligned: a tile's rows are whole cache lines (std::vector's 16 bytes split each across two; a 512-token
    // prompt of SmolLM2-135M took 1.18x the time)
    std::unique_ptr<uint16_t, decltype(&std::free)> a_bf16(
        static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(product.m_blocks * kRows * k_pad) * sizeof(uint16_t))), &std::free);
    if (a_bf16 == nullptr) throw std::bad_alloc();
    Convert convert{a.GetTensorData<float>(), a_bf16.get(), m, k, k_pad};
    context.ParallelFor(convert_task, static_cast<size_t>(product.m_blocks * kRows), 0, &convert);
    product.a = a_bf16.get();
    std::vector<float> full;  // the fallback paths' gated product, before its activation
    float* gated_y = product.outs[0].y;
    if (gated && path != Path::kAmx) {
      full.resize(static_cast<size_t>(m * groups * kGroup));
      product.outs[0] = Output{full.data(), 0, groups * kGroup};
      product.n = groups * kGroup;
    }
    switch (path) {
      case Path::kAmx:
        context.ParallelFor(amx_task, static_cast<size_t>(((product.m_blocks + kChunkBlocks - 1) / kChunkBlocks) *
                                                          (((groups + 1) / 2 + kChunkPairs - 1) / kChunkPairs)), 0, &product);
        break;
      case Path::kAvx512Bf16:
        context.ParallelFor(avx512bf16_task, static_cast<size_t>((groups + kBf16Groups - 1) / kBf16Groups), 0, &product);
        break;
      case Path::kGeneric:
        context.ParallelFor(generic_task, static_cast<size_t>(groups), 0, &product);
        break;
    }
    if (!full.empty()) gate_rows(full.data(), groups, gated_y, m, n);
  }
};

struct PromptMatMulOp : Ort::CustomOpBase<PromptMatMulOp, PromptMatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new PromptMatMulKernel(api, info); }
  const char* GetName() const { return "PromptMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 2 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t) const {
    return OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_VARIADIC;  // one output a split
  }
};

}  // namespace

// The path this process's kernels take (for the runtime's choice and the benchmarks): "amx", "avx512bf16" or "generic".
extern "C" __attribute__((visibility("default"))) const char* KvexportPromptGemmPath() {
  try {
    return path_name(pick_path());
  } catch (const std::exception&) {
    return "unavailable";
  }
}

// For CacheAttention's prompts on tiles (cache_attention.cc).
bool kvexport_amx_allowed() { return amx_allowed(); }

__attribute__((target("amx-tile"))) void kvexport_configure_tiles() {
  alignas(64) TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  // GCC's _tile_loadconfig tells the compiler it reads 8 bytes, not 64: without this the rows and widths were dropped
  // as dead stores once the configuration moved into a function of its own (ldtilecfg then faulted)
  __asm__ volatile("" : : "m"(config));
  _tile_loadconfig(&config);
}

void add_prompt_matmul(Ort::CustomOpDomain& domain) {
  static PromptMatMulOp op;
  domain.Add(&op);
}
