"""Counting and cutting text in tokens: the served model's tokenizer, or an approximation.

Workload lengths are in tokens, as the engine sees them. With a local model directory that
holds a ``tokenizer.json`` (every Hugging Face fast tokenizer, and kvtier's demo model) the
count is exact. Otherwise one token is taken as four bytes of UTF-8 text, OpenAI's rule of
thumb for English; the engine's own count (``usage.prompt_tokens``) is what the results
report either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

BYTES_PER_TOKEN = 4


class TokenCounter(Protocol):
    name: str

    def count(self, text: str) -> int:
        """Tokens in ``text``."""
        ...

    def cut(self, text: str, tokens: int) -> str:
        """The longest head of ``text`` of at most ``tokens`` tokens (as near as it gets)."""
        ...


class ApproxCounter:
    """One token per four bytes of UTF-8."""

    name = "approx-4-bytes"

    def count(self, text: str) -> int:
        return -(-len(text.encode()) // BYTES_PER_TOKEN)

    def cut(self, text: str, tokens: int) -> str:
        head = text.encode()[: tokens * BYTES_PER_TOKEN]
        return head.decode(errors="ignore")


class HfCounter:
    """A Hugging Face ``tokenizer.json``, loaded with the ``tokenizers`` library."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def cut(self, text: str, tokens: int) -> str:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if len(ids) <= tokens:
            return text
        return str(self._tok.decode(ids[:tokens]))


def counter_for(tokenizer: str | None) -> TokenCounter:
    """The tokenizer of a local model directory (or ``tokenizer.json``), else the
    approximation."""
    if tokenizer:
        path = Path(tokenizer).expanduser()
        file = path / "tokenizer.json" if path.is_dir() else path
        if file.is_file():
            try:
                return HfCounter(file)
            except ImportError:
                pass
    return ApproxCounter()
