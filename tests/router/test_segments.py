"""The router encodes a conversation's new text only: segments of the prompt are kept, the
result is the whole prompt's tokens, and a tokenizer that does not cut cleanly is caught."""

from __future__ import annotations

import logging
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import AddedToken, Regex, pre_tokenizers

from kvtier.router import segments
from kvtier.router.prompts import PromptRenderer
from kvtier.router.segments import SegmentEncoder, unsafe_reason


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    from kvtier.demo import ensure_demo_model

    return PromptRenderer(str(ensure_demo_model()))


def conversation(rng: random.Random, turns: int) -> list[list[dict[str, str]]]:
    """The messages of each turn of one chat: a long first message, then short turns, with
    blank lines, line breaks at the edges of messages and runs of spaces on the way."""
    words = ["the", "river", "city", "42", "x=1;", "(a)", "it's", "naïve", "東京", "🙂", "\n",
             "\n\n", "  ", "\t", "end.\n"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [{"role": "system", "content": text(300)}, {"role": "user", "content": text(900)}]
    out = [list(messages)]
    for _ in range(turns - 1):
        messages += [{"role": "assistant", "content": text(40)},
                     {"role": "user", "content": "\n" + text(30) + "\n"}]
        out.append(list(messages))
    return out


def test_every_turn_gets_the_whole_prompts_tokens_and_reuses_the_turn_before(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "CHECK_FIRST", 0)  # what it answers is the segments' own
    monkeypatch.setattr(segments, "CHECK_EVERY", 10**9)
    rng = random.Random(7)
    for chat in (conversation(rng, 6), conversation(rng, 6)):
        for turn, messages in enumerate(chat):
            before = renderer.segments.stats()
            body = {"messages": messages}
            got = renderer.tokens("chat", body)
            text = renderer.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=True)
            assert got == renderer.tokenizer(text, add_special_tokens=False)["input_ids"]
            after = renderer.segments.stats()
            assert after["enabled"]
            if turn:  # most of a later turn's text came from kept segments
                reused = int(after["reused_chars"]) - int(before["reused_chars"])
                assert reused > len(text) * 0.6, (turn, reused, len(text))


def test_a_next_turn_encodes_only_what_follows_the_last_turns_end(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last piece of a turn (where the next goes on) is remembered: the next turn's
    piece that starts with it encodes only its new messages, not the rest of that piece."""
    monkeypatch.setattr(segments, "CHECK_FIRST", 0)
    monkeypatch.setattr(segments, "CHECK_EVERY", 10**9)
    rng = random.Random(11)
    words = ["the", "river", "city", "42", "naïve", "東京", "end.\n", "x=1;"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n)).strip()

    messages = [{"role": "system", "content": text(300)}, {"role": "user", "content": text(900)}]
    previous = ""
    for turn in range(8):
        if turn:
            messages += [{"role": "assistant", "content": text(40)},
                         {"role": "user", "content": text(30)}]
        before = renderer.segments.stats()
        got = renderer.tokens("chat", {"messages": messages})
        whole = renderer.tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True)
        assert got == renderer.tokenizer(whole, add_special_tokens=False)["input_ids"]
        encoded = int(renderer.segments.stats()["encoded_chars"]) - int(before["encoded_chars"])
        if turn:
            assert whole.startswith(previous)
            assert encoded == len(whole) - len(previous), (turn, encoded)
        previous = whole
    assert int(renderer.segments.stats()["ends"]) >= 1


def test_remembered_ends_stay_within_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "ENTRY_COST", 4)
    encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=16,
                             max_tokens=8000)
    for i in range(300):
        text = f"{i:04d} shared words and more\nof them, then the end {i}\nlast {i}\n"
        assert encoder(text) == [ord(c) for c in text]
        assert int(encoder.stats()["ends_cost"]) <= 8000 // segments.LARGEST_SHARE
    grown = "0299 shared words and more\nof them, then the end 299\nlast 299\nand on"
    before = encoder.stats()["encoded_chars"]
    assert encoder(grown) == [ord(c) for c in grown]
    assert int(encoder.stats()["encoded_chars"]) - int(before) == len("and on")
    evicted = "0000 shared words and more\nof them, then the end 0\nlast 0\nand on"
    before = encoder.stats()["encoded_chars"]
    assert encoder(evicted) == [ord(c) for c in evicted]
    assert int(encoder.stats()["encoded_chars"]) - int(before) == len(evicted), "all new"


LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
          r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
         r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TRICKY = ["a", "Zz", "'s", "'LL", "42", "12345", " ", "  ", "\t", "\n", "\n\n", "\r\n", "\v",
          "\f", "\x85", "\u2028", "\x1c", "\xa0", "\u3000", "\u200b", "e\u0301", "\u00a8",
          "東京", "🙂", ".", "?!", "<|user|>", "(", "x=1;", "-", "\\"]


@pytest.mark.parametrize("name, pre", [
    ("gpt2", pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)),
    ("llama3", pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
    ("qwen2", pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])),
])
def test_the_pieces_of_the_segments_are_the_pieces_of_the_whole(
        name: str, pre: pre_tokenizers.PreTokenizer) -> None:
    """The exactness argument itself, on the pre-tokenizers of GPT-2, Llama 3 and Qwen2:
    byte-level BPE merges within pieces, so equal pieces give equal tokens."""
    encoder = SegmentEncoder(lambda t: [], name, min_chars=3)
    rng = random.Random(name)
    for _ in range(1500):
        text = "".join(rng.choice(TRICKY) for _ in range(rng.randint(1, 40)))
        whole = [p for p, _ in pre.pre_tokenize_str(text)]
        pieces = [p for seg in encoder.segments(text) for p, _ in pre.pre_tokenize_str(seg)]
        assert pieces == whole, repr(text)


def test_tokenizers_known_not_to_cut_cleanly_are_encoded_whole(
        renderer: PromptRenderer) -> None:
    from transformers import AutoTokenizer

    from kvtier.demo import ensure_demo_model

    assert unsafe_reason(renderer.tokenizer) is None and renderer.segments.enabled
    text = ("first line of a prompt that goes on\n<x>second line\n" * 40)
    stripping = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    stripping.add_tokens([AddedToken("<x>", lstrip=True)])
    prefixed = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    prefixed.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    inner = AutoTokenizer.from_pretrained(str(ensure_demo_model()))
    inner.add_tokens([AddedToken("\n<x>", normalized=False)])
    for tok, why in ((stripping, "strips"), (prefixed, "prefix space"),
                     (inner, "line break before a non-blank")):
        reason = unsafe_reason(tok)
        assert reason is not None and why in reason

        def encode(t: str, tok: object = tok) -> list[int]:
            return list(tok(t, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

        cut = SegmentEncoder(encode, why, min_chars=16)  # as if it were not known
        pieces = [t for seg in cut.segments(text) for t in encode(seg)]
        assert pieces != encode(text), "the refusal is needed: segments would differ"
        refused = SegmentEncoder(encode, why, min_chars=16, unsafe=reason)
        assert refused(text) == encode(text) and not refused.stats()["enabled"]


def test_cuts_depend_only_on_the_text_before_them() -> None:
    encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=16)
    rng = random.Random(3)
    text = "".join(rng.choice(["a", "b ", "\n", "c\n", "\n\n", " "]) for _ in range(3000))
    whole = encoder.segments(text)
    assert "".join(whole) == text
    assert all(len(s) >= 16 for s in whole[:-1])
    for end in range(0, len(text), 97):
        head = encoder.segments(text[:end])
        assert head[:-1] == whole[:max(len(head) - 1, 0)]  # all but the last are the same


def test_cuts_are_every_allowed_place_a_segment_apart() -> None:
    """The cuts are what scanning every line break between two non-blank characters in
    order, and taking each one at least ``min_chars`` past the last, gives: blanks,
    breaks at the edges, runs of breaks and non-ASCII blanks included."""
    import re

    def reference(text: str, min_chars: int) -> list[str]:
        cuts = [0]
        for match in re.finditer(r"(?<=\S\n)(?=\S)", text):
            if match.start() - cuts[-1] >= min_chars:
                cuts.append(match.start())
        return [text[a:b] for a, b in zip(cuts, [*cuts[1:], len(text)], strict=True) if b > a]

    rng = random.Random(5)
    for _ in range(300):
        min_chars = rng.choice([1, 2, 3, 8, 64])
        encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=min_chars)
        text = "".join(rng.choice(["a", "b ", "\n", "c\n", "\n\n", " ", "\u00a0", "\u3000\n",
                                   "\t", "東"]) for _ in range(rng.randrange(0, 400)))
        assert encoder.segments(text) == reference(text, min_chars), (text, min_chars)


def test_a_tokenizer_that_does_not_cut_cleanly_is_caught_and_answered_whole(
        caplog: pytest.LogCaptureFixture) -> None:
    def with_length(text: str) -> list[int]:  # every piece's tokens start with its length
        return [len(text), *map(ord, text)]

    encoder = SegmentEncoder(with_length, "odd", min_chars=8)
    text = "one line\ntwo line\nthree line\nfour line\n"
    with caplog.at_level(logging.WARNING, "kvtier.router"):
        assert encoder(text) == with_length(text)
        assert encoder(text + "five\n") == with_length(text + "five\n")
    assert not encoder.stats()["enabled"] and encoder.stats()["segments"] == 0
    assert len([r for r in caplog.records if "encoded whole" in r.getMessage()]) == 1


def test_checks_keep_coming_after_the_first_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tokenizer that differs only on some text is still caught later on."""
    def odd_on_z(text: str) -> list[int]:
        return [*map(ord, text), *([0] if text.endswith("z\n") else [])]

    monkeypatch.setattr(segments, "CHECK_EVERY", 4)
    encoder = SegmentEncoder(odd_on_z, "z", min_chars=4)
    wrong = 0
    for i in range(segments.CHECK_FIRST + 12):
        text = f"abcd\nefgh\nijkl{i}\nmnop" + ("z\nqrs" if i >= segments.CHECK_FIRST else "")
        wrong += encoder(text) != odd_on_z(text)
    assert not encoder.stats()["enabled"]
    assert 0 < wrong < segments.CHECK_EVERY  # sampled: a few misroutes at most, then whole


def test_what_is_kept_stays_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(segments, "ENTRY_COST", 4)
    encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=10,
                             max_tokens=400)
    for i in range(200):
        text = f"{i:04d} some words\nmore words here\nand the end {i}\n" * 3
        assert encoder(text) == [ord(c) for c in text]
        assert int(encoder.stats()["cost"]) <= 400
    one_huge = "x" * 500 + "\n" + "y" * 500  # more than an eighth of the bound: not kept
    before = encoder.stats()["segments"]
    assert encoder(one_huge) == [ord(c) for c in one_huge]
    assert encoder.stats()["segments"] == before


def test_a_short_last_piece_is_not_kept() -> None:
    """Where a turn's text ends the next turn goes on: a short last piece, different in
    every request, would fill the LRU with entries nobody asks for again."""
    encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=32)
    head = "a long shared beginning of text\n" * 4
    for i in range(500):
        text = head + f"unique tail {i}"
        assert encoder(text) == [ord(c) for c in text]
    assert int(encoder.stats()["segments"]) <= 4


def test_hostile_texts_cost_what_their_size_does() -> None:
    encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=1024)
    lines = "a\n" * 500_000  # a million characters, half a million cut points
    assert encoder(lines) == [ord(c) for c in lines]
    assert len(encoder.segments(lines)) <= len(lines) // 1024 + 1
    blank = "\n" * 100_000 + " " * 100_000  # nowhere to cut
    assert encoder.segments(blank) == [blank]
    assert encoder(blank) == [ord(c) for c in blank]


def test_threads_encoding_at_once_all_get_their_own_tokens() -> None:
    encoder = SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=32,
                             max_tokens=5000)
    shared = "a system prompt every thread shares\n" * 20
    failures: list[str] = []

    def work(n: int) -> None:
        rng = random.Random(n)
        text = shared
        for _ in range(60):
            text += f"turn {rng.random()}\nreply {n}\n"
            if encoder(text) != [ord(c) for c in text]:
                failures.append(text)

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(work, range(6)))
    assert failures == [] and encoder.stats()["enabled"]
