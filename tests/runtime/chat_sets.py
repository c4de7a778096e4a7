"""Instruction data shared by the chat-data tests (importable by the launched ranks): a ChatML
tokenizer directory (the suite's BPE with ``<|im_start|>``/``<|im_end|>`` added as special tokens
and the ChatML template in its tokenizer_config.json), conversations and prompt/completion pairs."""

from __future__ import annotations

import json
from pathlib import Path

from medley.data.bpe import CHATML, chatml_tokenizer

__all__ = ["CHATML", "chatml_tokenizer", "conversation", "write_chats", "write_pairs"]

TURNS = ["Bread is flour, water, salt and time.", "A starter is flour and water, alive.",
         "Knead the dough until it is smooth.", "Bake it hot, then let it cool."]


def conversation(i: int) -> list[dict[str, str]]:
    """A system line, then two user/assistant exchanges; the length varies with ``i``."""
    first, second = TURNS[i % 4], TURNS[(i + 1) % 4]
    return [{"role": "system", "content": "Answer as a baker."},
            {"role": "user", "content": f"What is bread? {first}"},
            {"role": "assistant", "content": " ".join([second] * (1 + i % 3))},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": first}]


def write_chats(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"messages": conversation(i)}) + "\n" for i in range(count)))
    return path


def write_pairs(path: Path, count: int) -> Path:
    rows = [{"prompt": f"Question: {TURNS[i % 4]} Answer:", "completion": " " + " ".join([TURNS[(i + 2) % 4]]
                                                                                         * (1 + i % 2))}
            for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
