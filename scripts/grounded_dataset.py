"""Write bench/datasets/grounded-edit.jsonl: input-grounded prompts for speculative decoding.

Each line asks the model to repeat a given text (a section of this repo's docs, 300-700 tokens
by the default model's tokenizer) word for word with its spelling corrected: an answer that
copies its prompt, where prompt lookup drafts pay (issue 51). The committed file was written
from the docs as they were on 2026-12-07; rerun to rebuild it from today's:

    .venv/bin/python scripts/grounded_dataset.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from transformers import AutoTokenizer

from backends.torch.loader import resolve_model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "datasets" / "grounded-edit.jsonl"
INSTRUCTION = (
    "Repeat the following text word for word, correcting any spelling mistakes. "
    "Output only the text.\n\n"
)
MIN_TOKENS, MAX_TOKENS, MAX_PROMPTS, OUTPUT_TOKENS = 300, 700, 24, 128


def sections(text: str) -> list[str]:
    """A markdown file's `## ` sections without code blocks or table rows."""
    out = []
    for block in re.split(r"\n(?=## )", text):
        block = re.sub(r"```.*?```", "", block, flags=re.S)
        lines = [line for line in block.splitlines() if not line.startswith("|")]
        out.append("\n".join(lines).strip())
    return out


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    texts = [
        block
        for doc in sorted((ROOT / "docs").glob("*.md"))
        for block in sections(doc.read_text())
        if MIN_TOKENS <= len(tokenizer(block)["input_ids"]) <= MAX_TOKENS
    ][:MAX_PROMPTS]
    lines = [
        {"messages": [{"role": "user", "content": INSTRUCTION + text}], "max_tokens": OUTPUT_TOKENS}
        for text in texts
    ]
    OUT.write_text("".join(json.dumps(line) + "\n" for line in lines))
    print(f"{len(lines)} prompts -> {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
