"""The generic path: any decoder-only transformers model's own code over the paged KV cache.

Like vLLM's Transformers backend and SGLang's `models/transformers.py`: the model's modeling
code runs as transformers wrote it (its rotary, norms, MLP, MoE routing, logits), and
attention goes to Carousel's attention backends, through a function registered with
transformers' `AttentionInterface` (`attention.py`; soft-capped layers in `softcap.py`). What
each layer's attention call looks like is read by one probe forward (`probe.py`);
`TransformersCausalLM` (`model.py`) is the runner's model; during its steps some HF modules
run Carousel's ops computing the same (`fusion.py`: fused q/k/v and gate/up in `siblings.py`,
the SiLU MLP kernel in `mlp.py`, kernel norms in `norms.py` and the residual add folded into
one in `residual.py`, packed linears in `linears.py`, swapped in and out by `swaps.py`);
`support.py` refuses, before any weight is read, what cannot run this way, and resolves
`--model-impl`.
"""
