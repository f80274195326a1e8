"""Speculative decoding with prompt-lookup (n-gram) drafts: the scheduler's side.

`config.py` parses `--speculative-config` (vLLM's spelling); `ngram.py` proposes drafts from a
sequence's own tokens (`history.py` keeps them in numpy, appended as they come); `policy.py`
sets each step's draft length from the load (`load_switch.py`) and each sequence's measured
acceptance (`acceptance.py`); `budget.py` bounds drafts by what a sequence may still emit and
by the step's token budget; `stats.py` counts drafts and accepted tokens in vLLM's names;
`thresholds.py` derives where drafting pays from measured step times
(scripts/spec_thresholds.py).
The drafts' verification (the rejection sampler) is the torch backend's:
backends/torch/sample/rejection.py. Nothing here touches a tensor.
"""
