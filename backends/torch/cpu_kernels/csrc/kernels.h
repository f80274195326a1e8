// Carousel's CPU kernels for the decode step (AVX-512; bf16 products with AVX512-BF16).
// Built on first use by backends/torch/cpu_kernels/__init__.py; see its docstring.
#pragma once

#include <torch/extension.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>

namespace carousel {

// Output columns of one packed weight tile (four 16-lane fp32 vectors).
constexpr int64_t kTileCols = 64;

// y (M, N) = x (M, K) @ w.T + bias, with `w` packed by `pack_weight` (tiles of kTileCols rows)
// and `bias` fp32, zero-padded to whole tiles.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                     const c10::optional<torch::Tensor>& bias);

// The fewest rows of x whose bf16 linears take AMX tiles (returns the previous figure;
// default 1), and whether this build and process can use AMX at all.
int64_t set_amx_min_rows(int64_t rows);
bool amx_built();

// How the AVX-512 linear asks for weights ahead (by CPU vendor; linear.cpp's stream_plan):
// whether a streaming pass asks for its own lines, and whether fp32 tiles of 7-32 rows go in
// K chunks. Returns the previous pair; not to be called while a linear runs. The AVX2 build
// has one plan and ignores it.
std::tuple<bool, bool> set_stream_plan(bool own_lines, bool chunked);

// silu(x @ gate.T) * (x @ up.T) (the MLP's first half), with gate and up packed together by
// `pack_gate_up` (each tile: 32 gate rows, then the same 32 up rows), rounding as
// silu_mul(linear(x, gate), linear(x, up)) does.
torch::Tensor linear_silu_mul(const torch::Tensor& x, const torch::Tensor& packed,
                              int64_t out_features);

// Decode attention over the paged cache, read in place: one query token per sequence.
void decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                      const torch::Tensor& context_lens, double scale, int64_t window,
                      const torch::Tensor& out);

// LlamaRMSNorm's formula over each row of x (N, H), rounding where HF's module rounds.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// hidden += delta in place (the residual stream), then rms_norm(hidden): one pass per row.
torch::Tensor add_rms_norm(const torch::Tensor& hidden, const torch::Tensor& delta,
                           const torch::Tensor& weight, double eps);

// silu(gate) * up (the MLP's activation), rounding where act_fn(gate) * up rounds.
torch::Tensor silu_mul(const torch::Tensor& gate, const torch::Tensor& up);

// Rotary embedding of the Q and K heads of a fused (N, (nh + 2 nkv) hd) projection, in place,
// and each token's K and V heads copied into its cache slot.
void rotary_write_kv(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                     const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                     const torch::Tensor& slots, int64_t num_heads, int64_t num_kv_heads);

// torch.argmax(x, dim=-1) of a (B, V) matrix: the first index of each row's maximum.
torch::Tensor argmax(const torch::Tensor& x);

// The decoder layers of a model whose steps are decodes only (one token per sequence), run
// in one call (decode_layers.cpp): per layer rms_norm, linear (QKV), rotary_write_kv,
// decode_attention, linear (O), add_rms_norm, linear_silu_mul, linear (down), add_rms_norm,
// as stacks/eager.py's `EagerStack` calls them. Weights are packed as `linear` takes them.
class DecodeStack {
 public:
  void add_layer(const torch::Tensor& input_norm, double input_eps, const torch::Tensor& qkv,
                 const c10::optional<torch::Tensor>& qkv_bias, const torch::Tensor& o_proj,
                 const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& post_norm,
                 double post_eps, const torch::Tensor& gate_up, int64_t intermediate,
                 const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                 const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t num_heads,
                 int64_t num_kv_heads, double scale, int64_t window);

  // A weight-only quantised copy of `projection` ("qkv", "o_proj", "gate", "up" or "down") of
  // layer `layer`, which forward() takes in its `quantized` steps: torch's own kernels, no
  // Carousel one. `group_size` > 0: aten::_weight_int4pack_mm_for_cpu (`weight` from
  // _convert_weight_to_int4pack_for_cpu, `scales` its (K / group, N, 2) scales and zeros);
  // 0: aten::_weight_int8pack_mm (`weight` int8 (N, K), `scales` one per output channel).
  // `bias` (full precision, unpacked) is added after, as layers/quant_linear.py does. gate
  // and up are quantised together or not at all.
  void quantize(int64_t layer, const std::string& projection, const torch::Tensor& weight,
                const torch::Tensor& scales, int64_t group_size,
                const c10::optional<torch::Tensor>& bias);

  // `hidden` (N, H) is the residual stream fresh from the embedding, updated in place and
  // returned; cos and sin (N, head_dim); slots (N,) each token's cache slot; block_tables
  // (N, nb) and context_lens (N,) as decode_attention takes them. `quantized`: every
  // projection with a copy from quantize() takes it (the MLP's gate and up then run apart,
  // joined by silu_mul), the others their packed weight.
  torch::Tensor forward(const torch::Tensor& hidden, const torch::Tensor& cos,
                        const torch::Tensor& sin, const torch::Tensor& slots,
                        const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                        bool quantized) const;

  size_t num_layers() const { return layers_.size(); }

 private:
  struct WeightOnly {
    torch::Tensor weight, scales;
    int64_t group_size;  // 0: int8 per output channel
    c10::optional<torch::Tensor> bias;
    torch::Tensor mm(const torch::Tensor& x) const;
  };
  enum Projection { kQkv, kOProj, kGate, kUp, kDown, kNumProjections };
  using Copies = std::array<std::optional<WeightOnly>, kNumProjections>;

  struct Layer {
    torch::Tensor input_norm;
    double input_eps;
    torch::Tensor qkv;
    c10::optional<torch::Tensor> qkv_bias;
    int64_t qkv_out;
    torch::Tensor o_proj;
    c10::optional<torch::Tensor> o_bias;
    torch::Tensor post_norm;
    double post_eps;
    torch::Tensor gate_up;
    int64_t intermediate;
    torch::Tensor down;
    c10::optional<torch::Tensor> down_bias;
    torch::Tensor k_cache, v_cache;
    int64_t num_heads, num_kv_heads, head_dim;
    double scale;
    int64_t window;  // -1: none
    Copies quantized;  // from quantize(), by Projection
  };
  std::vector<Layer> layers_;
};

}  // namespace carousel
