"""The router's prompt tokens follow vLLM's OpenAI server (the vLLM end-to-end test checks
them against a running engine; these pin the rules on the demo tokenizer)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvtier.keys import chunk_keys
from kvtier.router.keys import NamespaceInfo, Renderers, RequestKeys, pick_namespace
from kvtier.router.prompts import PromptRenderer, content_format

LOOPING = ("{% for m in messages %}<{{ m['role'] }}>{% for part in m['content'] %}"
           "[{{ part['text'] }}]{% endfor %}{% endfor %}{% if add_generation_prompt %}<a>"
           "{% endif %}")


@pytest.fixture(scope="module")
def renderer() -> PromptRenderer:
    from kvtier.demo import ensure_demo_model

    return PromptRenderer(str(ensure_demo_model()))


def test_completions_encode_with_special_tokens_unless_told(renderer: PromptRenderer) -> None:
    tok = renderer.tokenizer
    text = "The quick brown fox"
    assert renderer.tokens("completions", {"prompt": text}) == \
        tok(text, add_special_tokens=True)["input_ids"]
    assert renderer.tokens("completions", {"prompt": text, "add_special_tokens": False}) == \
        tok(text, add_special_tokens=False)["input_ids"]
    assert renderer.tokens("completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert renderer.tokens("completions", {"prompt": [[5, 6], [8]]}) == [5, 6]
    assert renderer.tokens("completions", {"prompt": ["a b", "c"]}) == \
        tok("a b", add_special_tokens=True)["input_ids"]
    assert renderer.tokens("completions", {"prompt": text, "truncate_prompt_tokens": 3}) is None


def test_chat_renders_the_template_to_text_then_encodes_without_specials(
        renderer: PromptRenderer) -> None:
    tok = renderer.tokenizer
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "one"},
                                             {"type": "text", "text": "two"}]}]
    joined = [messages[0], {"role": "user", "content": "one\ntwo"}]
    text = tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert renderer.tokens("chat", {"messages": messages}) == \
        tok(text, add_special_tokens=False)["input_ids"]
    open_text = tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=False)
    assert renderer.tokens("chat", {"messages": messages, "add_generation_prompt": False}) == \
        tok(open_text, add_special_tokens=False)["input_ids"]
    assert renderer.tokens("chat", {"messages": messages, "add_special_tokens": True}) == \
        tok(text, add_special_tokens=True)["input_ids"]


def test_a_template_that_loops_over_content_gets_the_parts(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    assert content_format(LOOPING) == "openai"
    assert content_format(renderer.tokenizer.get_chat_template()) == "string"
    monkeypatch.setattr(renderer.tokenizer, "chat_template", LOOPING)  # the model's own
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                      {"type": "text", "text": "y"}]}]}
    want = renderer.tokenizer("<user>[x][y]<a>", add_special_tokens=False)["input_ids"]
    assert renderer.tokens("chat", body) == want


def test_a_generation_block_is_parsed_as_transformers_parses_it(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    """``{% generation %}`` (transformers' assistant-mask tag) hides no content loop."""
    marked = ("{% for m in messages %}{% generation %}{% for part in m.content %}"
              "{{ part.text }}{% endfor %}{% endgeneration %}{% endfor %}")
    assert content_format(marked) == "openai"
    monkeypatch.setattr(renderer.tokenizer, "chat_template", marked)
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert renderer.tokens("chat", body) == \
        renderer.tokenizer("x", add_special_tokens=False)["input_ids"]


def test_a_template_that_does_not_compile_gives_no_tokens(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    for broken in ("{% for %}", "{{ messages | no_such_filter }}",
                   "{% if x %}" * 5000 + "{% endif %}" * 5000):
        assert content_format(broken) == "string"  # vLLM's fallback
        monkeypatch.setattr(renderer.tokenizer, "chat_template", broken)
        assert renderer.tokens("chat", {"messages": [{"role": "user", "content": "x"}]}) is None


def test_chat_template_kwargs_reach_the_template_only_when_it_reads_them(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    reads = ("{% for m in messages %}{{ m.content }}{% endfor %}"
             "{% if enable_thinking %}<think>{% endif %}{{ greeting }}")
    monkeypatch.setattr(renderer.tokenizer, "chat_template", reads)
    tok = renderer.tokenizer

    def tokens(**extra: Any) -> list[int] | None:
        return renderer.tokens("chat", {"messages": [{"role": "user", "content": "x"}],
                                        **extra})

    assert tokens(chat_template_kwargs={"greeting": "hi", "unread": 1}) == \
        tok("xhi", add_special_tokens=False)["input_ids"]
    assert tokens(reasoning_effort="high") == tok("x<think>", add_special_tokens=False)[
        "input_ids"]
    assert tokens(chat_template_kwargs={"tokenize": True}) is None  # as vLLM refuses it
    assert tokens(chat_template_kwargs=["not", "an", "object"]) is None


def test_a_request_supplied_chat_template_is_never_rendered(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = renderer.tokenizer.apply_chat_template

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(kw.get("chat_template"))
        return real(*args, **kw)

    monkeypatch.setattr(renderer.tokenizer, "apply_chat_template", spy)
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": LOOPING}
    assert renderer.tokens("chat", body) is None
    assert calls == [], "the client's Jinja was not rendered"
    assert renderer.tokens("chat", {"messages": body["messages"]}) is not None
    assert len(calls) == 1 and calls[0] != LOOPING

    # the router does not even hand it to a thread (nor load a tokenizer for it)
    class Refuse(Renderers):
        async def get(self, tokenizer: str) -> PromptRenderer | None:
            raise AssertionError("no renderer for a request-supplied template")

    got = asyncio.run(RequestKeys("chat", body, Refuse()).tokens("/nonexistent"))
    assert got is None


def test_what_it_cannot_reproduce_gives_no_tokens(renderer: PromptRenderer) -> None:
    image = {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://x/y.png"}}]}
    assert renderer.tokens("chat", {"messages": [image]}) is None
    tools: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]}
    assert renderer.tokens("chat", tools) is None
    assert renderer.tokens("chat", {"messages": []}) is None
    assert renderer.tokens("completions", {"prompt": {"no": 1}}) is None


def test_keys_follow_the_namespace_and_the_cache_salt() -> None:
    ns = NamespaceInfo(b"\x01" * 32, 4, "/nonexistent", "m")
    other = NamespaceInfo(b"\x02" * 32, 4, "/nonexistent", "m")
    ids = list(range(10))

    async def keys(body: dict[str, Any], space: NamespaceInfo) -> Any:
        got = await RequestKeys("completions", body, Renderers()).keys(space)
        assert got is not None
        return got.keys

    plain = asyncio.run(keys({"prompt": ids}, ns))
    assert list(plain) == chunk_keys(ns.fingerprint, ids, 4) and len(plain) == 2
    salted = asyncio.run(keys({"prompt": ids, "cache_salt": "tenant-a"}, ns))
    assert list(salted) == chunk_keys(ns.fingerprint, ids, 4, ("salt:tenant-a",))
    assert salted != plain
    assert asyncio.run(keys({"prompt": ids}, other)) != plain


def test_the_latest_namespace_of_a_model_wins() -> None:
    old = NamespaceInfo(b"\x01" * 32, 256, "/t", "m")
    new = NamespaceInfo(b"\x02" * 32, 256, "/t", "m")
    other = NamespaceInfo(b"\x03" * 32, 256, "/t", "n")
    assert pick_namespace([old, new, other], "m") is new
    assert pick_namespace([old, new, other], None) is None, "two models: which one?"
    assert pick_namespace([old, new], None) is new
    assert pick_namespace([other], "m") is None
    assert NamespaceInfo.parse({"namespace": "zz", "chunk_tokens": 1}) is None
    parsed = NamespaceInfo.parse({"namespace": "01" * 32, "chunk_tokens": 256, "model": "/p",
                                  "served_model_name": "m"})
    assert parsed == NamespaceInfo(b"\x01" * 32, 256, "/p", "m")


def test_a_conversations_next_turn_is_keyed_on_the_event_loop_and_long_text_in_a_thread(
        renderer: PromptRenderer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread costs two wake-ups and a wait for the GIL on a busy machine: a turn whose
    text the tokenizer has mostly seen is encoded inline; new long text, a body over
    INLINE_BODY_BYTES or one of unknown size goes to a thread. The tokens are the same."""
    from kvtier.router import keys as keys_module
    from kvtier.router import segments

    monkeypatch.setattr(segments, "CHECK_FIRST", 0)  # no whole-text checks in the way
    threaded: list[str] = []
    real = asyncio.to_thread

    async def counting(func: Any, /, *args: Any, **kwargs: Any) -> Any:
        threaded.append(getattr(func, "__name__", "?"))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(keys_module.asyncio, "to_thread", counting)

    class One(Renderers):
        async def get(self, tokenizer: str) -> PromptRenderer | None:
            return renderer

    def tokens(body: dict[str, Any], size: int | None) -> Any:
        got = asyncio.run(RequestKeys("chat", body, One(), size).tokens("demo"))
        return None if got is None else list(got)

    history = [{"role": "user", "content": "".join(f"line {i} of a long question\n"
                                                   for i in range(200))}]
    first = {"messages": history}
    assert tokens(first, 20_000) == renderer.tokens("chat", dict(first))
    assert len(threaded) == 1, "a conversation's first long text is encoded in a thread"
    turn = {"messages": [*history, {"role": "assistant", "content": "an answer"},
                         {"role": "user", "content": "and then?"}]}
    assert tokens(turn, 20_000) == renderer.tokens("chat", dict(turn))
    assert len(threaded) == 1, "the next turn is encoded on the loop"
    assert tokens(turn, keys_module.INLINE_BODY_BYTES + 1) == renderer.tokens("chat", dict(turn))
    assert tokens(turn, None) is not None
    assert len(threaded) == 3, "a large body, or one of unknown size, goes to a thread"
    many = {"messages": [{"role": "user", "content": "x"}] * (keys_module.INLINE_PARTS + 1)}
    assert tokens(many, 8_000) == renderer.tokens("chat", dict(many))
    assert len(threaded) == 4, "so does a small body of many messages (rendered per message)"


def test_a_prepared_turn_costs_only_its_new_text(renderer: PromptRenderer,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.router import segments

    monkeypatch.setattr(segments, "CHECK_FIRST", 0)
    monkeypatch.setattr(segments, "CHECK_EVERY", 10**9)
    history = [{"role": "system", "content": "rules\n" * 400},
               {"role": "user", "content": "a question\n" * 400}]
    first = renderer.prepare("chat", {"messages": history})
    assert first is not None and first.cost_chars > 6000
    assert list(first.finish()) == renderer.tokenizer(renderer.tokenizer.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True), add_special_tokens=False)[
            "input_ids"]
    more = [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
    again = renderer.prepare("chat", {"messages": more})
    assert again is not None and 0 < again.cost_chars < 2 * segments.MIN_CHARS + 100
    same = renderer.prepare("chat", {"messages": more})
    assert same is not None and same.cost_chars == again.cost_chars, "nothing encoded yet"
    again.finish()
    done = renderer.prepare("chat", {"messages": more})
    assert done is not None and done.cost_chars < segments.MIN_CHARS, "its segments kept"
    monkeypatch.setattr(segments, "CHECK_FIRST", 1)
    checked = segments.SegmentEncoder(lambda t: [ord(c) for c in t], "chars", min_chars=8)
    text = "one line\ntwo line\nthree line\n"
    assert checked.prepare(text).cost_chars == 2 * len(text), "a check encodes it whole too"
