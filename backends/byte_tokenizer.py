"""A tiny byte-level tokenizer with a chat template, for the weight-free simulator."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

EOS_TOKEN_ID = 256
BOS_TOKEN_ID = 257
_SPECIAL = {EOS_TOKEN_ID: "<|eos|>", BOS_TOKEN_ID: "<|bos|>"}


class ByteTokenizer:
    """Token i < 256 is byte i; 256 is EOS and 257 BOS. Mirrors the HF calls Carousel uses."""

    eos_token_id = EOS_TOKEN_ID
    bos_token_id = BOS_TOKEN_ID
    eos_token = _SPECIAL[EOS_TOKEN_ID]
    vocab_size = 258
    chat_template = "byte-chat"

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        data = bytearray()
        text = ""
        for token_id in token_ids:
            if token_id < 256:
                data.append(token_id)
            elif not skip_special_tokens:
                text += data.decode("utf-8", errors="replace") + _SPECIAL.get(token_id, "")
                data.clear()
        return text + data.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        return [self.decode([t], skip_special_tokens=False) for t in token_ids]

    def apply_chat_template(
        self,
        conversation: list[Mapping[str, Any]],
        tokenize: bool = False,
        add_generation_prompt: bool = True,
        **_: Any,
    ) -> str | list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text
