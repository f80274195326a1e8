// Every decoder layer of a decode-only step in one call: the kernels of this directory in the
// order stacks/eager.py's `EagerStack` calls them, with no Python between them.
//
// A bf16 decode step of SmolLM2 (30 layers, 9 kernel calls each) spent about 2 ms in the
// Python around the calls, a quarter of the step at one sequence (docs/benchmarks/history/).
// Each call here is the very kernel Python would have called, on the same tensors, so
// the step's output is bit for bit what the Python loop gives. In a quantised step the
// projections with weight-only copies call torch's own int4 / int8 kernels instead, as
// layers/quant_linear.py's QuantLinear does in the loop (nothing here computes them).
#include "kernels.h"

namespace carousel {

void DecodeStack::add_layer(const torch::Tensor& input_norm, double input_eps,
                            const torch::Tensor& qkv, const c10::optional<torch::Tensor>& qkv_bias,
                            const torch::Tensor& o_proj, const c10::optional<torch::Tensor>& o_bias,
                            const torch::Tensor& post_norm, double post_eps,
                            const torch::Tensor& gate_up, int64_t intermediate,
                            const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window) {
  TORCH_CHECK(k_cache.dim() == 4, "caches must be (num_blocks, block_size, nkv, hd)");
  TORCH_CHECK(input_norm.dim() == 1 && post_norm.sizes() == input_norm.sizes(),
              "norm weights must be (hidden,)");
  const int64_t head_dim = k_cache.size(3);
  layers_.push_back(Layer{input_norm, input_eps, qkv, qkv_bias,
                          (num_heads + 2 * num_kv_heads) * head_dim, o_proj, o_bias, post_norm,
                          post_eps, gate_up, intermediate, down, down_bias, k_cache, v_cache,
                          num_heads, num_kv_heads, head_dim, scale, window, {}});
}

void DecodeStack::quantize(int64_t layer, const std::string& projection,
                           const torch::Tensor& weight, const torch::Tensor& scales,
                           int64_t group_size, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()), "no layer ", layer);
  static const std::array<const char*, kNumProjections> names = {"qkv", "o_proj", "gate", "up",
                                                                 "down"};
  for (int p = 0; p < kNumProjections; ++p) {
    if (projection == names[p]) {
      layers_[layer].quantized[p] = WeightOnly{weight, scales, group_size, bias};
      return;
    }
  }
  TORCH_CHECK(false, "no projection named ", projection);
}

torch::Tensor DecodeStack::WeightOnly::mm(const torch::Tensor& x) const {
  const torch::Tensor in = x.contiguous();
  torch::Tensor y = group_size > 0
                        ? at::_weight_int4pack_mm_for_cpu(in, weight, group_size, scales)
                        : at::_weight_int8pack_mm(in, weight, scales);
  return bias.has_value() ? y + *bias : y;
}

torch::Tensor DecodeStack::forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                                   const torch::Tensor& sin, const torch::Tensor& slots,
                                   const torch::Tensor& block_tables,
                                   const torch::Tensor& context_lens, bool quantized) const {
  TORCH_CHECK(!layers_.empty(), "a DecodeStack without layers");
  const int64_t n = hidden.size(0), width = hidden.size(1);
  torch::Tensor x = rms_norm(hidden, layers_[0].input_norm, layers_[0].input_eps);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    const Copies none;
    const Copies& copies = quantized ? l.quantized : none;
    TORCH_CHECK(copies[kGate].has_value() == copies[kUp].has_value(),
                "gate and up are quantised together or not at all");
    const int64_t q_size = l.num_heads * l.head_dim;
    torch::Tensor qkv =
        copies[kQkv] ? copies[kQkv]->mm(x) : linear(x, l.qkv, l.qkv_out, l.qkv_bias);
    rotary_write_kv(qkv, cos, sin, l.k_cache, l.v_cache, slots, l.num_heads, l.num_kv_heads);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, l.num_heads, l.head_dim});
    torch::Tensor attn = torch::empty({n, l.num_heads, l.head_dim}, qkv.options());
    decode_attention(q, l.k_cache, l.v_cache, block_tables, context_lens, l.scale, l.window,
                     attn);
    const torch::Tensor heads = attn.view({n, q_size});
    torch::Tensor o = copies[kOProj] ? copies[kOProj]->mm(heads)
                                     : linear(heads, l.o_proj, width, l.o_bias);
    x = add_rms_norm(hidden, o, l.post_norm, l.post_eps);
    torch::Tensor act = copies[kGate] ? silu_mul(copies[kGate]->mm(x), copies[kUp]->mm(x))
                                      : linear_silu_mul(x, l.gate_up, l.intermediate);
    torch::Tensor mlp = copies[kDown] ? copies[kDown]->mm(act)
                                      : linear(act, l.down, width, l.down_bias);
    if (i + 1 < layers_.size())
      x = add_rms_norm(hidden, mlp, layers_[i + 1].input_norm, layers_[i + 1].input_eps);
    else
      hidden.add_(mlp);
  }
  return hidden;
}

}  // namespace carousel
