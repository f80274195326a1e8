"""Token sampler: logits [B, V] plus each sequence's SamplingParams -> one TokenLogprob per row.

Per row, in order (vLLM / OpenAI semantics):
  1. `logit_bias` is added (ids outside the vocab are ignored);
  2. `repetition_penalty` (HF / vLLM) over prompt + output tokens: positive logits are divided
     by it, negative ones multiplied;
  3. `presence_penalty` and `frequency_penalty` (OpenAI) over output tokens:
     `logit -= presence * (count > 0) + frequency * count`;
  3b. a constrained sequence's grammar masks the tokens it forbids (-inf; grammar_mask.py),
     only in that sequence's row;
  4. `temperature == 0` (below 1e-5, as in vLLM) takes the argmax; otherwise the logits are
     divided by the temperature, then `top_k`, `top_p` and `min_p` mask tokens (logits tied
     with the last kept one are kept), and one token is drawn by inverting the row's CDF at
     a uniform from the sequence's own CPU `torch.Generator`.

Logprobs (the sampled token's, and the top alternatives when asked) are computed only for
rows whose params ask for them (`logprobs` not None; the others' `logprob` is NaN), and are
those of `log_softmax` of the logits after steps 1-3b: after bias, penalties and the grammar,
before temperature, top-k, top-p and min-p. Masked tokens (`-inf` logits) get a logprob of
`-inf`.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable

import torch

from backends.torch import kernels
from backends.torch.sample.grammar_mask import GrammarMask
from backends.torch.sample.token_counts import TokenCounts
from schedulers import defaults
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence, TokenLogprob

_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF  # torch.Generator.manual_seed takes 64-bit seeds
# NOTE: top-p keeps a token while the mass sorted before it is below `top_p - _TOP_P_SLACK`,
# so float rounding cannot keep one extra token when a prefix sums exactly to top_p.
_TOP_P_SLACK = 1e-6
# like vLLM, a temperature this small samples greedily (dividing by it would overflow)
_GREEDY_BELOW = 1e-5
# top-p first looks for each nucleus among this many largest logits (a top-k, not a full sort)
_NUCLEUS_HEAD = 1024


class Sampler:
    """Samples one token per row of a logits batch; each sequence draws from its own generator.

    A sequence's generator is seeded with its own `seed` (the engine gives choice i seed + i)
    (so the n choices of one seeded request differ, as in vLLM), else with a random seed; it
    lives until `release(seq_id)`. Generators stay on the CPU whatever `device` is: one draw
    per sampled row, sent to the device in one copy, and the same seed gives the same
    uniforms on every device. A row's sample depends only on its logits, its params and its
    generator, never on its batch mates. A constrained sequence (`seq.grammar`) has its row
    masked by its grammar (grammar_mask.py, one bitmask for `max_num_seqs` rows); a batch
    without one skips that step entirely.
    """

    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        max_num_seqs: int = defaults.MAX_NUM_SEQS,
        *,
        cpu_kernels: bool = True,
        host_branches: bool | None = None,
    ) -> None:
        """`host_branches`: let top-p ask the device whether it may skip work (a host sync;
        None: only on the CPU, where a sync costs nothing)."""
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._argmax = _argmax_of(self.device, cpu_kernels)
        self._generators: dict[int, torch.Generator] = {}
        self._grammar_mask = GrammarMask(vocab_size, max_rows=max_num_seqs)
        self._counts = TokenCounts(vocab_size, self.device)
        self._host_branches = self.device.type == "cpu" if host_branches is None else host_branches
        self._host_out = torch.empty(0, dtype=torch.float64, pin_memory=_pinnable(self.device))

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], greedy_ids: torch.Tensor | None = None
    ) -> list[TokenLogprob]:
        """Sample one token for each sequence from `logits` [B, V], row i for `seqs[i]`.

        `greedy_ids` [B]: the rows' argmax over the vocabulary, already computed (a CUDA
        graph's), taken when the whole batch is plain greedy.
        """
        if logits.shape[0] != len(seqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(seqs)} sequences")
        if not seqs:
            return []
        params = [seq.sampling_params for seq in seqs]
        adjusted = any(p.logit_bias or p.has_penalties for p in params)
        constrained = any(seq.grammar is not None for seq in seqs)
        if not constrained and all(_is_plain_greedy(p) for p in params):
            # NOTE: in the model's dtype: widening to fp32 is exact, so the argmax is the same
            if greedy_ids is None:
                greedy_ids = self._argmax(logits[:, : self.vocab_size])
            return [TokenLogprob(token_id, math.nan, []) for token_id in greedy_ids.tolist()]
        # NOTE: the steps below write into the logits, so they get a copy of the caller's
        # (which may be the model's own inference-mode tensor, where in-place writes are
        # refused): one copy, the widening's own where it widens
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=adjusted or constrained)
        if adjusted:
            _apply_logit_bias(logits, params)
            _apply_penalties(logits, seqs, self._counts)
        if constrained:  # NOTE: other rows stay untouched
            self._grammar_mask(logits, [seq.grammar for seq in seqs])
        if all(_is_greedy(p) for p in params):
            tokens = self._argmax(logits)  # [B]
        else:
            tokens = self._pick(logits, seqs)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return [TokenLogprob(token_id, math.nan, []) for token_id in tokens.tolist()]
        # NOTE: a full-vocab log_softmax costs more than the argmax: only where asked
        rows = torch.tensor(wanted, device=logits.device) if len(wanted) < len(seqs) else None
        asked = logits if rows is None else logits[rows]  # [R, V]
        # NOTE: log_softmax, not logits - logsumexp: torch's logsumexp (its exp) takes a slow
        # path on -inf, 4x slower on a grammar-masked batch (docs/benchmarks/history/)
        log_probs = asked.log_softmax(dim=-1)  # [R, V]
        picked = tokens if rows is None else tokens[rows]
        values = log_probs.gather(-1, picked[:, None]).squeeze(-1)  # [R]
        top_counts = [params[i].logprobs or 0 for i in wanted]
        k = min(max(top_counts), log_probs.shape[-1])
        top_values, top_ids = log_probs.topk(k, dim=-1) if k else (values[:, None][:, :0],) * 2
        # NOTE: the step's tokens, logprobs and top alternatives come back in one copy
        host = self._to_host([tokens, values, top_ids.flatten(), top_values.flatten()])
        b, r = len(seqs), len(wanted)
        token_ids = [int(t) for t in host[:b]]
        logprobs = [math.nan] * b
        tops: list[list[tuple[int, float]]] = [[] for _ in seqs]
        ids_at, values_at = b + r, b + r + r * k
        for j, (i, n) in enumerate(zip(wanted, top_counts, strict=True)):
            logprobs[i] = host[b + j]
            ids = host[ids_at + j * k : ids_at + j * k + n]
            tops[i] = list(zip((int(t) for t in ids), host[values_at + j * k :][:n], strict=True))
        return [
            TokenLogprob(token_id, logprob, top)
            for token_id, logprob, top in zip(token_ids, logprobs, tops, strict=True)
        ]

    def _to_host(self, parts: list[torch.Tensor]) -> list[float]:
        """`parts` flattened into one float64 list (ids up to 2^53 are exact): one copy to
        the host, into a pinned buffer on CUDA."""
        flat = torch.cat([part.to(torch.float64) for part in parts])
        if flat.device.type == "cpu":
            return flat.tolist()  # type: ignore[no-any-return]
        if self._host_out.numel() < flat.numel():
            self._host_out = torch.empty(
                2 * flat.numel(), dtype=torch.float64, pin_memory=_pinnable(self.device)
            )
        host = self._host_out[: flat.numel()]
        host.copy_(flat, non_blocking=True)
        torch.cuda.current_stream(flat.device).synchronize()
        return host.tolist()  # type: ignore[no-any-return]

    def release(self, seq_id: int) -> None:
        """Forget the generator and token counts of a finished sequence."""
        self._generators.pop(seq_id, None)
        self._counts.release(seq_id)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Token ids [B] for a batch mixing greedy and sampled rows."""
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        greedy = [i for i, seq in enumerate(seqs) if _is_greedy(seq.sampling_params)]
        if greedy:
            rows = torch.tensor(greedy, device=logits.device)
            tokens[rows] = self._argmax(logits[rows])
        sampled = [i for i, seq in enumerate(seqs) if not _is_greedy(seq.sampling_params)]
        rows = torch.tensor(sampled, device=logits.device)
        tokens[rows] = self._sample(logits[rows], [seqs[i] for i in sampled])
        return tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Draw one token id per row of `logits` [R, V] (all rows have temperature > 0)."""
        probs = self.target_probs(logits, [seq.sampling_params for seq in seqs])
        uniforms = [self._uniform(seq) for seq in seqs]
        return _inverse_cdf(probs, uniforms)

    def target_probs(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution [R, V] each row draws from: `logits` (after bias, penalties and
        the grammar; rows with temperature > 0) divided by the temperature, top-k, top-p and
        min-p applied, softmaxed. What the rejection sampler verifies drafts against."""
        temperature = _column([p.temperature for p in params], logits)
        logits = logits / temperature  # [R, V]
        floors = []
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            floors.append(_top_k_top_p_floor(logits, params, host_branches=self._host_branches))
        if any(p.min_p > 0.0 for p in params):
            floors.append(_min_p_floor(logits, params))
        for floor in floors:
            logits.masked_fill_(logits < floor, -math.inf)
        return logits.softmax(dim=-1)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax [R] (the kernel's where it runs), as greedy rows take it."""
        return self._argmax(logits)

    def generator(self, seq: Sequence) -> torch.Generator:
        """`seq`'s own generator (created and seeded on first use)."""
        return self._generator(seq)

    def biased(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """A float32 copy of `logits` [R, V] cut to the vocabulary, each row's `logit_bias`
        added: steps 1-3b for rows without penalties or a grammar (a verifying row's)."""
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)
        _apply_logit_bias(logits, params)
        return logits

    def _uniform(self, seq: Sequence) -> float:
        """The next draw in [0, 1) from the sequence's generator."""
        return torch.rand(1, dtype=torch.float64, generator=self._generator(seq)).item()

    def _generator(self, seq: Sequence) -> torch.Generator:
        """The sequence's generator, created and seeded on first use."""
        generator = self._generators.get(seq.seq_id)
        if generator is None:
            seed = seq.sampling_params.seed
            seed = secrets.randbits(64) if seed is None else seed & _SEED_MASK
            generator = torch.Generator()
            generator.manual_seed(seed)
            self._generators[seq.seq_id] = generator
        return generator


def _pinnable(device: torch.device) -> bool:
    """Whether host buffers for `device` are pinned (CUDA present and the device is one)."""
    return device.type == "cuda" and torch.cuda.is_available()


def _argmax_of(device: torch.device, cpu_kernels: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """Row argmax: Carousel's CPU kernel where it runs (torch's took 0.5 ms for 32 x 49152
    fp32 logits on the 2-core CPU, single-threaded), else `torch.argmax`; both give the first
    index of the maximum (a NaN counting as the maximum)."""
    native = kernels.native() if cpu_kernels and device.type == "cpu" else None
    if native is None:
        return lambda logits: logits.argmax(dim=-1)
    return native.argmax  # type: ignore[no-any-return]


def _is_plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing to add first (bias, penalties) and no logprobs to report."""
    plain = not (params.logit_bias or params.has_penalties) and params.logprobs is None
    return plain and _is_greedy(params)


def _is_greedy(params: SamplingParams) -> bool:
    """Whether the row takes the argmax (temperature 0, or too small to divide by)."""
    return params.temperature < _GREEDY_BELOW


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """`values` as a float32 column [R, 1] on the device of `like`."""
    return torch.tensor(values, dtype=torch.float32, device=like.device)[:, None]


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    """Add each row's logit_bias in place; token ids outside [0, V) are ignored."""
    vocab = logits.shape[-1]
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, p in enumerate(params):
        for token_id, bias in p.logit_bias.items():
            if 0 <= int(token_id) < vocab:
                rows.append(row)
                token_ids.append(int(token_id))
                biases.append(float(bias))
    if rows:
        index = (
            torch.tensor(rows, device=logits.device),
            torch.tensor(token_ids, device=logits.device),
        )
        values = torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        logits.index_put_(index, values, accumulate=True)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], counts: TokenCounts) -> None:
    """Apply repetition, presence and frequency penalties in place, only to rows that set them."""
    rows = [i for i, seq in enumerate(seqs) if seq.sampling_params.has_penalties]
    if not rows:
        return
    penalized = [seqs[i] for i in rows]
    params = [seq.sampling_params for seq in penalized]
    row_index = torch.tensor(rows, device=logits.device)
    sub = logits[row_index]  # [R, V]
    if any(p.repetition_penalty != 1.0 for p in params):
        keys = [(seq.seq_id, "all") for seq in penalized]
        all_ids = [seq.all_token_ids() for seq in penalized]
        seen = counts.rows(keys, all_ids, list(penalized)) > 0  # [R, V]
        penalty = _column([p.repetition_penalty for p in params], sub)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        keys = [(seq.seq_id, "output") for seq in penalized]
        outputs = [seq.output_token_ids for seq in penalized]
        output_counts = counts.rows(keys, outputs, list(penalized))  # [R, V]
        presence = _column([p.presence_penalty for p in params], sub)
        frequency = _column([p.frequency_penalty for p in params], sub)
        sub = sub - frequency * output_counts - presence * (output_counts > 0)
    logits[row_index] = sub


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Token ids [R]: row r's first token whose cumulative probability exceeds uniforms[r]."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:].contiguous()  # [R, 1]
    target = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)[:, None] * total
    tokens = torch.searchsorted(cdf, target, right=True)  # [R, 1]
    # NOTE: rounding can make target == total; cap at the last token with nonzero prob.
    last = torch.searchsorted(cdf, total, right=False)  # [R, 1]
    return torch.minimum(tokens, last).squeeze(-1)


def _top_k_top_p_floor(
    logits: torch.Tensor,
    params: list[SamplingParams],
    head: int = _NUCLEUS_HEAD,
    *,
    host_branches: bool = True,
) -> torch.Tensor:
    """The smallest logit [R, 1] each row keeps under its top_k, then its top_p.

    top_k keeps the k largest logits (0 = off); top_p then keeps the smallest prefix of that
    set, sorted and renormalized, whose mass reaches top_p (1.0 = off), at least one token.
    Nuclei are first looked for among the `head` largest logits; the whole vocab is sorted
    only when one does not fit there.
    NOTE: the floor is a value, so logits tied with the last kept one are kept too: the result
    depends neither on how ties sort nor on how many columns the batch sorted.
    `host_branches=False` (a GPU) asks the device nothing: both the head's nuclei and the
    whole sort's are computed, and each row takes the head's where its nucleus fits there.
    """
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    has_top_p = any(p.top_p < 1.0 for p in params)
    width = max(top_k)
    if has_top_p and all(k <= head or k == vocab for k in top_k):
        width = min(width, head)
    if width < vocab:
        sorted_logits = logits.topk(width, dim=-1).values  # [R, W], descending
    else:
        sorted_logits = logits.sort(dim=-1, descending=True).values  # [R, V]
    k_column = torch.tensor(top_k, device=logits.device)[:, None]
    floor = sorted_logits.gather(-1, (k_column - 1).clamp_max(width - 1))  # [R, 1] k-th largest
    floor.masked_fill_(k_column > width, -math.inf)  # k = V beyond the sorted head: no top_k
    if not has_top_p:
        return floor
    sorted_logits = sorted_logits.masked_fill(sorted_logits < floor, -math.inf)
    nucleus_floor, overflows = _nucleus_floor(
        logits, sorted_logits, k_column, params, host_branches
    )
    if overflows is not None and host_branches and bool(overflows.any()):
        return _top_k_top_p_floor(logits, params, head=vocab)
    if overflows is not None and not host_branches:
        whole = _top_k_top_p_floor(logits, params, head=vocab, host_branches=False)
        return torch.where(overflows, whole, torch.maximum(floor, nucleus_floor))
    return torch.maximum(floor, nucleus_floor)


def _nucleus_floor(
    logits: torch.Tensor,
    sorted_logits: torch.Tensor,
    top_k: torch.Tensor,
    params: list[SamplingParams],
    host_branches: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The smallest logit [R, 1] in each row's top_p nucleus (-inf where top_p is off), and
    which rows' nuclei do not fit in the W columns ([R, 1] bool; None when W is the vocab).

    `sorted_logits` [R, W] are the W largest of `logits` [R, V], descending, with those outside
    each row's top_k (`top_k` [R, 1], V = off) already -inf. Masses are running sums, the
    same whatever W. `host_branches`: skip the whole row's mass where no row needs it (a
    host sync; without it, it is always computed).
    """
    vocab = logits.shape[-1]
    top = sorted_logits[:, :1]
    running = (sorted_logits - top).exp().cumsum(dim=-1)  # [R, W] unnormalized mass so far
    total = running[:, -1:]  # [R, 1] mass of each row's top-k set ...
    if not host_branches or bool((top_k == vocab).any()):  # ... or of its whole row (no top_k)
        whole_row = (logits - top).exp().cumsum(dim=-1)[:, -1:]
        total = torch.where(top_k < vocab, total, whole_row)
    cutoffs = [p.top_p - _TOP_P_SLACK if p.top_p < 1.0 else math.inf for p in params]
    cutoff = _column(cutoffs, logits) * total  # [R, 1]
    is_on = cutoff.isfinite()
    overflows = None if sorted_logits.shape[-1] == vocab else is_on & (running[:, -1:] < cutoff)
    mass_before = torch.nn.functional.pad(running[:, :-1], (1, 0))  # [R, W]
    num_kept = (mass_before < cutoff).sum(dim=-1, keepdim=True).clamp_min_(1)  # [R, 1]
    return sorted_logits.gather(-1, num_kept - 1).masked_fill_(~is_on, -math.inf), overflows


def _min_p_floor(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The smallest logit [R, 1] with prob >= min_p * the row's top prob (0 = off)."""
    min_p = _column([p.min_p for p in params], logits)
    return logits.amax(dim=-1, keepdim=True) + min_p.log()
