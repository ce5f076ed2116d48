// kvexport's prompt product for ONNX Runtime: Y = A @ W with W in bf16, on the CPU's bf16 units.
//
// The op `kvexport.PromptMatMul`:
//   inputs  A [..., K] float, W [N/16 (rounded up), K/2 (rounded up to 16), 16, 2] bf16: W's columns in groups of
//           16, each group's rows in pairs (the "VNNI" layout both AMX tiles and AVX512-BF16's dot products read),
//           zero past K and N; bias [N] float (optional)
//   outputs Y [..., N] float
//   attributes K, N
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

struct Product {
  const uint16_t* a;  // [M_pad, K_pad] bf16, zero past M and K
  const uint16_t* w;  // [groups, K_pad/2, 16, 2]
  const float* bias;  // null or [N]
  float* y;           // [M, N]
  int64_t m, n, k_pad, groups, m_blocks;
};

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
  const int64_t valid_rows = std::min<int64_t>(rows, p.m - row0);
  const int64_t cols = std::min<int64_t>(kGroup, p.n - col0);
  for (int64_t r = 0; r < valid_rows; ++r) {
    float* y = p.y + (row0 + r) * p.n + col0;
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
  if (row0 + 16 <= p.m && col0 + kGroup <= p.n && p.bias == nullptr) {
    float* y = p.y + row0 * p.n + col0;
    switch (t) {
      case 0: _tile_stored(0, y, p.n * 4); break;
      case 1: _tile_stored(1, y, p.n * 4); break;
      case 2: _tile_stored(2, y, p.n * 4); break;
      default: _tile_stored(3, y, p.n * 4); break;
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

__attribute__((target("amx-tile,amx-bf16,avx512f"))) void amx_task(void* data, size_t index) {
  const Product& p = *static_cast<const Product*>(data);
  kvexport_configure_tiles();  // tmm0-3: C (16 x 16 fp32); tmm4-5: A (16 x 32 bf16); tmm6-7: W (16 pairs x 16 x 2)
  alignas(64) float tile[kGroup * kGroup];
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

struct PromptMatMulKernel {
  int64_t k, n;
  Path path;

  PromptMatMulKernel(const OrtApi&, const OrtKernelInfo* info) : path(pick_path()) {
    Ort::ConstKernelInfo kernel_info(info);
    k = kernel_info.GetAttribute<int64_t>("K");
    n = kernel_info.GetAttribute<int64_t>("N");
    if (k <= 0 || n <= 0) throw std::invalid_argument("PromptMatMul: K and N must be positive");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    auto a = context.GetInput(0), w = context.GetInput(1);
    auto a_shape = a.GetTensorTypeAndShapeInfo().GetShape();
    if (a_shape.empty() || a_shape.back() != k)
      throw std::invalid_argument("PromptMatMul: A's last dimension must be K = " + std::to_string(k));
    const int64_t k_pad = (k + kStep - 1) / kStep * kStep, groups = (n + kGroup - 1) / kGroup;
    const std::vector<int64_t> w_shape{groups, k_pad / 2, kGroup, 2};
    if (w.GetTensorTypeAndShapeInfo().GetShape() != w_shape)
      throw std::invalid_argument("PromptMatMul: W must be [N/16, K/2, 16, 2] (rounded up to whole groups and steps)");
    const float* bias = nullptr;
    if (context.GetInputCount() > 2) {
      auto b = context.GetInput(2);
      if (b != nullptr) {
        if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n))
          throw std::invalid_argument("PromptMatMul: bias must hold N values");
        bias = b.GetTensorData<float>();
      }
    }
    int64_t m = 1;
    for (size_t i = 0; i + 1 < a_shape.size(); ++i) m *= a_shape[i];
    auto y_shape = a_shape;
    y_shape.back() = n;
    auto y = context.GetOutput(0, y_shape);
    if (m == 0) return;
    const int64_t m_blocks = (m + kRows - 1) / kRows;
    // 64-byte aligned: a tile's rows are whole cache lines (std::vector's 16 bytes split each across two; a 512-token
    // prompt of SmolLM2-135M took 1.18x the time)
    std::unique_ptr<uint16_t, decltype(&std::free)> a_bf16(
        static_cast<uint16_t*>(std::aligned_alloc(64, static_cast<size_t>(m_blocks * kRows * k_pad) * sizeof(uint16_t))), &std::free);
    if (a_bf16 == nullptr) throw std::bad_alloc();
    Convert convert{a.GetTensorData<float>(), a_bf16.get(), m, k, k_pad};
    context.ParallelFor(convert_task, static_cast<size_t>(m_blocks * kRows), 0, &convert);
    Product product{a_bf16.get(), static_cast<const uint16_t*>(w.GetTensorRawData()), bias,
                    y.GetTensorMutableData<float>(), m, n, k_pad, groups, m_blocks};
    switch (path) {
      case Path::kAmx:
        context.ParallelFor(amx_task, static_cast<size_t>(((m_blocks + kChunkBlocks - 1) / kChunkBlocks) *
                                                          (((groups + 1) / 2 + kChunkPairs - 1) / kChunkPairs)), 0, &product);
        break;
      case Path::kAvx512Bf16:
        context.ParallelFor(avx512bf16_task, static_cast<size_t>((groups + kBf16Groups - 1) / kBf16Groups), 0, &product);
        break;
      case Path::kGeneric:
        context.ParallelFor(generic_task, static_cast<size_t>(groups), 0, &product);
        break;
    }
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
