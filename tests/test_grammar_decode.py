"""The default model, decoding under the mask at temperature 1: outputs always validate.

Until the engine is wired, the decode loop here calls the building blocks in the order the
sampler and the engine will: fill each constrained row's bitmask, apply it to the logits
right before sampling, accept the sampled token, finish when the grammar terminates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from backends.torch.runner.backend import TorchBackend
from backends.torch.sample.grammar_mask import allocate_bitmask, apply_grammar_bitmask
from gateway.api.outputs.tool_parser import parse_tool_calls
from gateway.api.outputs.tools import (
    check_tools,
    render_conversation,
    resolve_tool_choice,
    tool_grammar,
)
from schedulers.batch import Batch
from schedulers.block_manager import BlockManager
from schedulers.sampling_params import SamplingParams
from schedulers.sequence import Sequence
from schedulers.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarSpec,
    SequenceGrammar,
)
from tests.schemas import PERSON

pytestmark = pytest.mark.real_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    return TorchBackend.load("default", kv_cache_gb=0.25, max_model_len=1024)


@pytest.fixture(scope="module")
def compiler(backend: TorchBackend) -> Iterator[GrammarCompiler]:
    grammar_compiler = GrammarCompiler(
        backend.tokenizer,
        vocab_size=backend.hf_model.config.vocab_size,
        stop_token_ids=backend.eos_token_ids,
    )
    yield grammar_compiler
    grammar_compiler.close()


def generate(
    backend: TorchBackend,
    grammar: CompiledGrammar,
    messages: list[dict[str, Any]],
    n: int,
    max_tokens: int = 80,
) -> list[tuple[str, bool]]:
    """n samples at temperature 1 under `grammar`: (text, whether the grammar terminated)."""
    tokenizer = backend.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    spec = backend.kv_cache_spec
    blocks = BlockManager(spec.num_blocks, spec.block_size)
    seqs = [
        Sequence(i, f"r{i}", prompt, SamplingParams(max_tokens, temperature=1.0, seed=7 + i))
        for i in range(n)
    ]
    states = {seq.seq_id: SequenceGrammar(grammar) for seq in seqs}
    bitmask = allocate_bitmask(n, backend.hf_model.config.vocab_size)
    inner = backend.sampler

    def sample(
        logits: torch.Tensor, batch_seqs: list[Sequence], greedy_ids: torch.Tensor | None = None
    ) -> Any:
        # greedy_ids (a CUDA graph's argmax) would skip the mask: the masked logits decide
        for row, seq in enumerate(batch_seqs):
            states[seq.seq_id].fill_bitmask(bitmask, row)
        logits = logits.float().clone()  # the model's (inference-mode) logits stay untouched
        apply_grammar_bitmask(logits, list(range(len(batch_seqs))), bitmask)
        return inner(logits, batch_seqs)

    backend.sampler = sample  # type: ignore[assignment]
    try:
        running = list(seqs)
        while running:
            batch = Batch(iteration=0)
            for seq in running:
                target = seq.num_tokens
                blocks.allocate(seq, target)
                batch.add(seq, target - seq.num_computed_tokens)
            out = backend.execute(batch)
            for seq in list(running):
                seq.num_computed_tokens = seq.num_tokens
                token = out.sampled[seq.seq_id].token_id
                assert states[seq.seq_id].accept(token), "a sampled token broke the grammar"
                seq.output_token_ids.append(token)
                if states[seq.seq_id].is_terminated or seq.num_output_tokens >= max_tokens:
                    running.remove(seq)
    finally:
        backend.sampler = inner
        for seq in seqs:
            blocks.free(seq)
            inner.release(seq.seq_id)
    eos = backend.eos_token_ids
    return [
        (
            tokenizer.decode([t for t in seq.output_token_ids if t not in eos]),
            states[seq.seq_id].is_terminated,
        )
        for seq in seqs
    ]


def test_sampled_outputs_validate_against_the_schema(
    backend: TorchBackend, compiler: GrammarCompiler
) -> None:
    grammar = compiler.compile(GrammarSpec.json_schema(PERSON))
    assert isinstance(grammar, CompiledGrammar)
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    outputs = generate(backend, grammar, messages, n=2)
    finished = [text for text, done in outputs if done]
    assert finished, outputs
    for text in finished:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_required_tool_call_parses_into_a_valid_call(
    backend: TorchBackend, compiler: GrammarCompiler
) -> None:
    tools = check_tools([WEATHER])
    assert isinstance(tools, list)
    choice = resolve_tool_choice("required", tools)
    assert not isinstance(choice, type(None))
    spec = tool_grammar(choice)  # type: ignore[arg-type]
    assert spec is not None
    grammar = compiler.compile(spec)
    assert isinstance(grammar, CompiledGrammar), grammar
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    rendered = render_conversation(history, tools, renders_tools=False)
    assert not isinstance(rendered, type(None))
    outputs = generate(backend, grammar, rendered.messages, n=2)  # type: ignore[union-attr]
    finished = [text for text, done in outputs if done]
    assert finished, outputs
    for text in finished:
        parsed = parse_tool_calls(text)
        assert parsed.content is None and parsed.tool_calls, text
        for call in parsed.tool_calls:
            assert call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
