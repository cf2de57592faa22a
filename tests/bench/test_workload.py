"""The multi-round workload: turn structure, lengths in tokens, interleaving, determinism."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvtier.bench.tokens import ApproxCounter, HfCounter, counter_for
from kvtier.bench.workload import WorkloadConfig, build, long_users
from kvtier.errors import ConfigError

APPROX = ApproxCounter()


def small(**kw: object) -> WorkloadConfig:
    base: dict[str, object] = {"num_users": 4, "num_rounds": 3, "system_prompt_tokens": 120,
                               "user_history_tokens": 300, "question_tokens": 20,
                               "answer_tokens": 16}
    base.update(kw)
    return WorkloadConfig(**base)  # type: ignore[arg-type]


def test_each_turn_repeats_the_previous_one_plus_its_answer_and_a_new_question() -> None:
    wl = build(small(), APPROX)
    answers = ["first answer", "second answer"]
    m0 = wl.messages(2, 0, [])
    m2 = wl.messages(2, 2, answers)
    assert [m["role"] for m in m0] == ["system", "user"]
    assert [m["role"] for m in m2] == ["system", "user", "assistant", "user", "assistant",
                                       "user"]
    assert m2[: len(m0)] == m0  # the earlier prompt is a prefix: what a cache can reuse
    assert [m2[2]["content"], m2[4]["content"]] == answers
    conv = wl.conversations[2]
    assert m0[1]["content"] == f"{conv.history}\n\n{conv.questions[0]}"
    assert m2[5]["content"] == conv.questions[2]  # history only in the first user message
    assert m0[0]["content"] == wl.messages(0, 0, [])[0]["content"]  # one shared system prompt
    with pytest.raises(ValueError):
        wl.messages(2, 2, answers[:1])


def test_completion_prompts_grow_the_same_way() -> None:
    wl = build(small(), APPROX)
    p1 = wl.prompt(1, 1, ["an answer"])
    p0 = wl.prompt(1, 0, [])
    assert p1.startswith(p0) and p1.endswith("Assistant:")
    assert "Assistant: an answer\nUser: " in p1


def test_lengths_are_in_tokens_with_the_approximation() -> None:
    wl = build(small(), APPROX)
    assert APPROX.count(wl.system_prompt) == 120
    for conv in wl.conversations:
        assert APPROX.count(conv.history) == 300
        assert [APPROX.count(q) for q in conv.questions] == [20, 20, 20]
        assert conv.answer_tokens == (16, 16, 16)


def test_lengths_are_in_tokens_with_a_real_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from kvtier.bench.textgen import WORDS

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = counter_for(str(tmp_path))
    assert isinstance(counter, HfCounter)
    wl = build(small(), counter)
    assert abs(counter.count(wl.system_prompt) - 120) <= 1  # a cut may merge across the end
    assert all(abs(counter.count(c.history) - 300) <= 1 for c in wl.conversations)


def test_schedule_is_round_major_so_every_other_user_speaks_between_two_turns() -> None:
    n = 5
    wl = build(small(num_users=n, num_rounds=4, warmup_rounds=1), APPROX)
    order = wl.schedule()
    assert len(order) == n * 4
    assert [(t.user, t.round) for t in order[:n + 1]] == [(u, 0) for u in range(n)] + [(0, 1)]
    for user in range(n):
        positions = [i for i, t in enumerate(order) if t.user == user]
        assert [order[i].round for i in positions] == [0, 1, 2, 3]
        for a, b in itertools.pairwise(positions):
            between = {order[i].user for i in range(a + 1, b)}
            assert between == set(range(n)) - {user} and b - a == n
    assert [t.warmup for t in order] == [True] * n + [False] * (3 * n)


def test_a_shuffled_order_changes_each_round_and_keeps_every_turn_once() -> None:
    """Each round is every user once, rounds in order, warm-up first; the order within a
    round is the seed's own, different between rounds, the same on every build."""
    n = 8
    config = small(num_users=n, num_rounds=4, warmup_rounds=1, user_order="shuffled", seed=7)
    order = build(config, APPROX).schedule()
    rounds = [[t.user for t in order if t.round == r] for r in range(4)]
    assert [t.round for t in order] == sorted(t.round for t in order)
    assert all(sorted(users) == list(range(n)) for users in rounds)
    assert len({tuple(users) for users in rounds}) > 1, "not the same order every round"
    assert order == build(config, APPROX).schedule(), "deterministic in the seed"
    # the fixed order over two round-robin backends pins each user; shuffled does not
    fixed = build(small(num_users=n, num_rounds=4), APPROX).schedule()
    backends = [{(t.user, i % 2) for i, t in enumerate(sched)} for sched in (fixed, order)]
    assert len(backends[0]) == n and len(backends[1]) > n
    assert [t.warmup for t in order] == [True] * n + [False] * (3 * n)


def test_long_users_are_the_requested_share_spread_out() -> None:
    assert long_users(10, 0.3) == {3, 6, 9}
    assert long_users(4, 0.0) == set() and long_users(4, 1.0) == {0, 1, 2, 3}
    wl = build(small(num_users=10, long_fraction=0.3, long_history_tokens=900), APPROX)
    sizes = [APPROX.count(c.history) for c in wl.conversations]
    assert sizes.count(900) == 3 and sizes.count(300) == 7
    assert [c.long for c in wl.conversations].count(True) == 3


def test_text_is_deterministic_in_the_seed_and_unique_per_user() -> None:
    a, b = build(small(seed=7), APPROX), build(small(seed=7), APPROX)
    c = build(small(seed=8), APPROX)
    assert a == b
    assert a.system_prompt != c.system_prompt
    histories = [conv.history for conv in a.conversations]
    for i, h in enumerate(histories):
        for other in histories[i + 1:]:
            common = next(i for i, (x, y) in enumerate(zip(h, other, strict=False)) if x != y)
            assert common < 20  # "Notes of user ": far less than one cache chunk


def test_empty_system_prompt_and_history_are_left_out() -> None:
    wl = build(small(system_prompt_tokens=0, user_history_tokens=0), APPROX)
    m = wl.messages(0, 0, [])
    assert [x["role"] for x in m] == ["user"]
    assert m[0]["content"] == wl.conversations[0].questions[0]


@pytest.mark.parametrize(("kw", "flag"), [
    ({"num_users": 0}, "--num-users"), ({"answer_tokens": 0}, "--answer-len"),
    ({"user_history_tokens": -1}, "--user-history-prompt"),
    ({"long_fraction": 1.5}, "--long-fraction"),
    ({"warmup_rounds": 3}, "--warmup-rounds"), ({"user_order": "random"}, "--user-order"),
])
def test_bad_settings_name_the_flag(kw: dict[str, object], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        small(**kw)
