// kvexport's CPU decode attention: one token a row over an in-place fp32 cache, for ONNX Runtime.
//
// The op `kvexport.DecodeAttention` means what com.microsoft.GroupQueryAttention means for a call
// of one token a row over a shared past/present buffer, without rotary, softcap or head sink:
//   inputs  query [B, 1, N*D], key [B, 1, Nkv*D], value [B, 1, Nkv*D],
//           past_key [B, Nkv, C, D], past_value [B, Nkv, C, D], seqlens_k [B] (int32),
//           attention_bias (optional) [B or 1, N or 1, 1, T] added to the scores
//   outputs output [B, 1, N*D], present_key, present_value [B, Nkv, C, D]
//   attributes num_heads, kv_num_heads, scale (0: 1/sqrt(D)), local_window_size (-1: none)
// A row's new key and value go to position seqlens_k[b] of its cache; it attends to the
// positions 0..seqlens_k[b] (the last local_window_size of them where that is set). Where
// present is bound to past's buffer (the in-place cache) only the new rows are written.
//
// Why: ONNX Runtime 1.31.1's CPU GroupQueryAttention reads a 16-row decode's fp32 cache at
// about 22 GB/s on 2 Zen 5 cores, where the cores stream 38 GB/s, and every query head reads
// its group's keys again. Here one task takes a row's KV head, reads each key and value once
// for the group's query heads, and the tasks run on the session's own intra-op threads.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

struct Problem {
  const float* query;
  float* output;
  const float* past_key;    // present's buffer once the new rows are in it
  const float* past_value;
  const int32_t* seqlens;
  const float* bias;  // null, or [bias_b, bias_h, 1, bias_t]
  int64_t bias_b, bias_h, bias_t;
  int64_t heads, kv_heads, head_size, capacity, window;
  float scale;
};

// One row's KV head: scores of its group's query heads, softmax, the weighted sum of values.
__attribute__((target_clones("avx512f", "avx2", "default")))
void attend(const Problem& p, int64_t b, int64_t kvh, std::vector<float>& scores) {
  const int64_t D = p.head_size, G = p.heads / p.kv_heads;
  const int64_t last = p.seqlens[b];
  const int64_t start = p.window > 0 ? std::max<int64_t>(0, last + 1 - p.window) : 0;
  const int64_t n = last + 1 - start;
  scores.resize(static_cast<size_t>(G * n));
  const float* keys = p.past_key + ((b * p.kv_heads + kvh) * p.capacity + start) * D;
  const float* values = p.past_value + ((b * p.kv_heads + kvh) * p.capacity + start) * D;
  const float* q = p.query + (b * p.heads + kvh * G) * D;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = keys + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
      scores[g * n + t] = dot * p.scale;
    }
  }
  if (p.bias != nullptr) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = kvh * G + g;
      const float* row = p.bias + ((p.bias_b == 1 ? 0 : b) * p.bias_h + (p.bias_h == 1 ? 0 : h)) * p.bias_t + start;
      for (int64_t t = 0; t < n; ++t) scores[g * n + t] += row[t];
    }
  }
  float* out = p.output + (b * p.heads + kvh * G) * D;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
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
    std::fill(out + g * D, out + (g + 1) * D, 0.0f);
  }
  for (int64_t t = 0; t < n; ++t) {
    const float* v = values + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const float weight = scores[g * n + t];
      float* og = out + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += weight * v[d];
    }
  }
}

void attend_task(void* data, size_t index) {
  thread_local std::vector<float> scores;
  const Problem& p = *static_cast<const Problem*>(data);
  const auto i = static_cast<int64_t>(index);
  attend(p, i / p.kv_heads, i % p.kv_heads, scores);
}

struct DecodeAttentionKernel {
  int64_t heads, kv_heads, window;
  float scale;

  DecodeAttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo kernel_info(info);
    heads = kernel_info.GetAttribute<int64_t>("num_heads");
    kv_heads = kernel_info.GetAttribute<int64_t>("kv_num_heads");
    scale = kernel_info.GetAttribute<float>("scale");
    window = kernel_info.GetAttribute<int64_t>("local_window_size");
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0)
      throw std::invalid_argument("DecodeAttention: num_heads must be a positive multiple of kv_num_heads");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext context(raw);
    auto query = context.GetInput(0), key = context.GetInput(1), value = context.GetInput(2);
    auto past_key = context.GetInput(3), past_value = context.GetInput(4), seqlens = context.GetInput(5);
    const auto q_shape = query.GetTensorTypeAndShapeInfo().GetShape();
    const auto cache_shape = past_key.GetTensorTypeAndShapeInfo().GetShape();
    if (q_shape.size() != 3 || q_shape[1] != 1 || cache_shape.size() != 4)
      throw std::invalid_argument("DecodeAttention: one token a row ([B, 1, N*D]) over a [B, Nkv, C, D] cache");
    const int64_t B = q_shape[0], D = cache_shape[3], C = cache_shape[2];
    if (q_shape[2] != heads * D || cache_shape[0] != B || cache_shape[1] != kv_heads)
      throw std::invalid_argument("DecodeAttention: the query's and the cache's shapes disagree with the heads");
    const int32_t* lengths = seqlens.GetTensorData<int32_t>();
    for (int64_t b = 0; b < B; ++b)
      if (lengths[b] < 0 || lengths[b] >= C)
        throw std::out_of_range("DecodeAttention: seqlens_k " + std::to_string(lengths[b]) + " is outside the cache's " +
                                std::to_string(C) + " positions");

    auto output = context.GetOutput(0, q_shape);
    auto present_key = context.GetOutput(1, cache_shape);
    auto present_value = context.GetOutput(2, cache_shape);
    float* pk = present_key.GetTensorMutableData<float>();
    float* pv = present_value.GetTensorMutableData<float>();
    const size_t cache_bytes = static_cast<size_t>(B * kv_heads * C * D) * sizeof(float);
    if (pk != past_key.GetTensorData<float>()) std::memcpy(pk, past_key.GetTensorData<float>(), cache_bytes);
    if (pv != past_value.GetTensorData<float>()) std::memcpy(pv, past_value.GetTensorData<float>(), cache_bytes);
    const float* k = key.GetTensorData<float>();
    const float* v = value.GetTensorData<float>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = ((b * kv_heads + h) * C + lengths[b]) * D, from = (b * kv_heads + h) * D;
        std::memcpy(pk + at, k + from, static_cast<size_t>(D) * sizeof(float));
        std::memcpy(pv + at, v + from, static_cast<size_t>(D) * sizeof(float));
      }

    Problem problem{query.GetTensorData<float>(), output.GetTensorMutableData<float>(), pk, pv, lengths,
                    nullptr, 1, 1, 0, heads, kv_heads, D, C, window,
                    scale != 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(D))};
    if (context.GetInputCount() > 6) {
      auto bias = context.GetInput(6);
      if (bias != nullptr) {
        const auto shape = bias.GetTensorTypeAndShapeInfo().GetShape();
        if (shape.size() != 4 || (shape[0] != 1 && shape[0] != B) || (shape[1] != 1 && shape[1] != heads) ||
            shape[2] != 1)
          throw std::invalid_argument("DecodeAttention: attention_bias must be [B or 1, N or 1, 1, T]");
        for (int64_t b = 0; b < B; ++b)
          if (lengths[b] >= shape[3])
            throw std::out_of_range("DecodeAttention: attention_bias is narrower than a row's positions");
        problem.bias = bias.GetTensorData<float>();
        problem.bias_b = shape[0];
        problem.bias_h = shape[1];
        problem.bias_t = shape[3];
      }
    }
    context.ParallelFor(attend_task, static_cast<size_t>(B * kv_heads), 0, &problem);
  }
};

struct DecodeAttentionOp : Ort::CustomOpBase<DecodeAttentionOp, DecodeAttentionKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new DecodeAttentionKernel(api, info); }
  const char* GetName() const { return "DecodeAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 7; }
  ONNXTensorElementDataType GetInputType(size_t index) const {
    return index == 5 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t index) const {
    return index == 6 ? OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_OPTIONAL
                      : OrtCustomOpInputOutputCharacteristic::INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* api_base) {
  static DecodeAttentionOp op;
  static std::once_flag initialized;
  std::call_once(initialized, [api_base] { Ort::InitApi(api_base->GetApi(ORT_API_VERSION)); });
  try {
    static Ort::CustomOpDomain domain{"kvexport"};
    static std::once_flag added;
    std::call_once(added, [] { domain.Add(&op); });
    Ort::UnownedSessionOptions(options).Add(domain);
  } catch (const std::exception& error) {
    return Ort::GetApi().CreateStatus(ORT_FAIL, error.what());
  }
  return nullptr;
}
