"""The engine's defaults, written once.

The gateway's settings (gateway/settings/groups.py), `SchedulerConfig`, the torch backend's
config, the block manager and every signature that takes a policy name read them here, so a
server, a script and a test that leave a knob out all get the same engine.
"""

from __future__ import annotations

#: the batching policy an engine runs when none is named
SCHEDULER = "orca"
#: the most sequences in one batch: the policy's cap, and the rows the backend's step
#: buffers (staged inputs, sampler, CUDA graphs) and its KV plan are sized for
MAX_NUM_SEQS = 32
#: the token budget of one iteration
MAX_NUM_BATCHED_TOKENS = 2048
#: tokens per KV block
BLOCK_SIZE = 16
#: seconds an output grammar may compile before its request is refused
GRAMMAR_COMPILE_TIMEOUT_S = 10.0
