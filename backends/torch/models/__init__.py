"""The architectures the native path implements: one file per family, and the registry.

Each family file (`llama.py`: Llama, Mistral, Qwen2, Qwen3) is the only code that reads a HF
model's attribute names. It turns a loaded HF model into a `ModelWeights` record (base.py):
per decoder layer, the attention geometry, the fused Q/K/V and the other projections' weights,
the norms, the activation; and it declares how the family's checkpoint names map (the GGUF
4-bit blocks, the tensor-parallel slicing rules). Everything downstream (the linears, the layer
ops, the three layer stacks, quantisation, tensor parallelism) is fed from that record.

Adding an architecture: one family file here, registered in `registry.py`, plus its tiny
random model in backends/torch/testing/tiny_models.py (docs/architecture.md, "How to add").
"""

from backends.torch.models.base import (
    ArchitectureFamily,
    DecoderLayerWeights,
    LinearWeights,
    ModelWeights,
    NormWeights,
)
from backends.torch.models.registry import (
    architecture_of,
    check_architecture,
    family_of,
    family_of_gguf,
    supported_architectures,
    weights_of,
)

__all__ = [
    "ArchitectureFamily",
    "DecoderLayerWeights",
    "LinearWeights",
    "ModelWeights",
    "NormWeights",
    "architecture_of",
    "check_architecture",
    "family_of",
    "family_of_gguf",
    "supported_architectures",
    "weights_of",
]
