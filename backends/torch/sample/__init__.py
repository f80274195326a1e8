"""Sampling a step's logits: the sampler (sampler.py), output grammars' masks
(grammar_mask.py) and the penalties' token counts (token_counts.py)."""
