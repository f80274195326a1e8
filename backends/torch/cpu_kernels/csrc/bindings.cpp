// The Python module of Carousel's CPU kernels (the GIL is released while they run).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Carousel's AVX-512 CPU kernels for the decode step";
  m.def("linear", &carousel::linear, "y = x @ w.T + bias over a packed weight",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::arg("bias") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("linear_silu_mul", &carousel::linear_silu_mul,
        "silu(x @ gate.T) * (x @ up.T) over a weight from pack_gate_up", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("out_features"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_amx_min_rows", &carousel::set_amx_min_rows,
        "the fewest rows whose bf16 linears take AMX tiles; returns the previous figure",
        pybind11::arg("rows"));
  m.def("amx_built", &carousel::amx_built, "whether bf16 linears can take AMX tiles here");
  m.def("set_stream_plan", &carousel::set_stream_plan,
        "how linear asks for weights ahead (own lines, fp32 K chunks); returns the previous",
        pybind11::arg("own_lines"), pybind11::arg("chunked"));
  m.def("decode_attention", &carousel::decode_attention,
        "one-token-per-sequence attention over the paged cache, in place",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("context_lens"), pybind11::arg("scale"),
        pybind11::arg("window"), pybind11::arg("out"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm", &carousel::rms_norm, "RMSNorm over each row", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("add_rms_norm", &carousel::add_rms_norm,
        "hidden += delta in place, then RMSNorm of hidden", pybind11::arg("hidden"),
        pybind11::arg("delta"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("silu_mul", &carousel::silu_mul, "silu(gate) * up", pybind11::arg("gate"),
        pybind11::arg("up"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rotary_write_kv", &carousel::rotary_write_kv,
        "rotary on a fused QKV's Q and K heads in place, K/V into their cache slots",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"),
        pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("argmax", &carousel::argmax, "the first index of each row's maximum", pybind11::arg("x"),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  pybind11::class_<carousel::DecodeStack>(m, "DecodeStack",
                                          "every decoder layer of a decode-only step, one call")
      .def(pybind11::init<>())
      .def("add_layer", &carousel::DecodeStack::add_layer, pybind11::arg("input_norm"),
           pybind11::arg("input_eps"), pybind11::arg("qkv"), pybind11::arg("qkv_bias"),
           pybind11::arg("o_proj"), pybind11::arg("o_bias"), pybind11::arg("post_norm"),
           pybind11::arg("post_eps"), pybind11::arg("gate_up"), pybind11::arg("intermediate"),
           pybind11::arg("down"), pybind11::arg("down_bias"), pybind11::arg("k_cache"),
           pybind11::arg("v_cache"), pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"),
           pybind11::arg("scale"), pybind11::arg("window"))
      .def("quantize", &carousel::DecodeStack::quantize, pybind11::arg("layer"),
           pybind11::arg("projection"), pybind11::arg("weight"), pybind11::arg("scales"),
           pybind11::arg("group_size"), pybind11::arg("bias") = pybind11::none())
      .def("forward", &carousel::DecodeStack::forward, pybind11::arg("hidden"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slots"),
           pybind11::arg("block_tables"), pybind11::arg("context_lens"),
           pybind11::arg("quantized") = false,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("__len__", &carousel::DecodeStack::num_layers);
}
