"""A request's prompt tokens, computed as vLLM 0.32's OpenAI server computes them.

The router must hash exactly the token ids the engine hashes, so this follows vLLM's
``renderers`` (read from vLLM 0.32.0; facts, not code):

- ``/v1/completions``: a string prompt is encoded with ``add_special_tokens`` as the request
  says (default **true**); a list of ids is used as is; of a batch, the first prompt.
- ``/v1/chat/completions``: messages become a conversation (string content, or text parts
  joined by ``"\\n"`` when the chat template reads ``content`` as a string, kept as
  ``{"type": "text", ...}`` parts when it loops over it), the tokenizer's chat template is
  rendered to **text** with
  ``add_generation_prompt`` (default true), ``continue_final_message``, ``documents``,
  ``reasoning_effort`` and ``chat_template_kwargs`` (filtered to what the template reads or
  ``apply_chat_template`` accepts), and the text is encoded with ``add_special_tokens``
  (default **false** for chat).

What it does not reproduce, and then says "no tokens" (the request is routed by the
strategy's fallback): media parts, tools, a server-side ``--chat-template``, harmony and
Mistral tokenizers, prompt embeddings. The connector does not cache multimodal prompts
either.

A request's own ``chat_template`` is never rendered: it is Jinja from the client, and
rendering it (CPU-bound, in a thread that holds the GIL) could stall the router's event loop
for every request; vLLM 0.32 refuses it anyway unless started with
``--trust-request-chat-template``. Such a request gets no tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Protocol

from kvtier.router.segments import SegmentEncoder, unsafe_reason

log = logging.getLogger("kvtier.router")

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}
"""Content part types vLLM treats as text, and the field holding their text."""
BILLING_HEADER = "x-anthropic-billing-header"
"""A system-prompt line vLLM drops (it changes every request)."""


class Unrenderable(Exception):
    """The request uses something this module does not reproduce exactly."""


class Encoding(Protocol):
    """A prompt ready to be encoded: ``cost_chars`` characters still go through the
    tokenizer in ``finish``."""

    @property
    def cost_chars(self) -> int: ...

    def finish(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class Given:
    """Token ids the request gave: nothing to encode."""

    ids: list[int]
    cost_chars: ClassVar[int] = 0

    def finish(self) -> list[int]:
        return self.ids


@dataclass(frozen=True)
class Whole:
    """Text encoded whole (with special tokens: not cut into segments)."""

    encode: Callable[[str], list[int]]
    text: str

    @property
    def cost_chars(self) -> int:
        return len(self.text)

    def finish(self) -> list[int]:
        return self.encode(self.text)


def finish(encoding: Encoding) -> Sequence[int] | None:
    """``encoding``'s tokens, or None if the tokenizer failed on them."""
    try:
        return encoding.finish()
    except Exception as exc:
        log.debug("prompt not keyed: %s: %s", type(exc).__name__, exc)
        return None


class PromptRenderer:
    """One tokenizer (a model directory or hub name), applied as vLLM applies it."""

    def __init__(self, tokenizer: str) -> None:
        from transformers import AutoTokenizer

        self.name = tokenizer
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.segments = SegmentEncoder(self._encode_plain, tokenizer,
                                       unsafe=unsafe_reason(self.tokenizer))
        """Encodes text without special tokens, reusing what earlier prompts shared."""

    def tokens(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as a list, or None when they cannot be computed exactly
        here."""
        ids = self.ids(endpoint, body)
        return None if ids is None else list(ids)

    def ids(self, endpoint: str, body: dict[str, Any]) -> Sequence[int] | None:
        """:meth:`tokens` as the encoder gives them (an ``array`` when segmented: no Python
        int per token on the way to the chunk hashes)."""
        encoding = self.prepare(endpoint, body)
        return None if encoding is None else finish(encoding)

    def prepare(self, endpoint: str, body: dict[str, Any]) -> Encoding | None:
        """The prompt rendered to text (or read as ids), the tokenizer not run yet: its
        ``cost_chars`` is what :func:`finish` will still encode. None when the tokens cannot
        be computed exactly here."""
        try:
            if endpoint == "chat":
                return self._prepare_chat(body)
            return self._prepare_completion(body)
        except Unrenderable as exc:
            log.debug("prompt not keyed: %s", exc)
        except Exception as exc:  # a template or tokenizer error: vLLM will answer it
            log.debug("prompt not keyed: %s: %s", type(exc).__name__, exc)
        return None

    def _prepare_completion(self, body: dict[str, Any]) -> Encoding:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_ids(prompt):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, list) and _is_ids(prompt):
            return Given([int(t) for t in prompt])
        if not isinstance(prompt, str):
            raise Unrenderable("prompt is neither text nor token ids")
        _plain_request(body)
        return self._encoding(prompt, bool(body.get("add_special_tokens", True)))

    def _prepare_chat(self, body: dict[str, Any]) -> Encoding:
        refuse_request_template(body)
        _plain_request(body)
        if body.get("tools"):
            raise Unrenderable("tools are rendered by vLLM's pydantic models")
        template = self._template()
        conversation = conversation_of(body.get("messages"), content_format(template))
        if any(m["role"] == "developer" for m in conversation) and not _knows_developer(template):
            conversation = _developer_as_system(conversation)
        text = self.tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, return_dict=False,
            **self._template_kwargs(body, template))
        if not isinstance(text, str):
            raise Unrenderable("the chat template did not render to text")
        return self._encoding(text, bool(body.get("add_special_tokens", False)))

    def _encoding(self, text: str, add_special_tokens: bool) -> Encoding:
        if not add_special_tokens:
            return self.segments.prepare(text)
        return Whole(self._encode_special, text)

    def _encode_special(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _encode_plain(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template(self) -> str:
        template = self.tokenizer.get_chat_template()
        if not isinstance(template, str):
            raise Unrenderable("no chat template")
        return template

    def _template_kwargs(self, body: dict[str, Any], template: str) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        user = body.get("chat_template_kwargs") or {}
        if not isinstance(user, dict):
            raise Unrenderable("chat_template_kwargs is not an object")
        if extra["reasoning_effort"] is not None and "enable_thinking" not in user:
            extra["enable_thinking"] = extra["reasoning_effort"] != "none"
        # vLLM merges the request's kwargs under these, dropping unset (None / "auto") values
        merged = {**user, **{k: v for k, v in extra.items() if v is not None and v != "auto"}}
        if {"chat_template", "tokenize"} & merged.keys():
            raise Unrenderable("chat_template_kwargs names chat_template or tokenize")
        accepted = _template_variables(template) | _apply_parameters()
        return {k: v for k, v in merged.items()
                if k in accepted and k not in ("return_dict", "conversation")}


def brings_own_template(body: Mapping[str, Any]) -> bool:
    """The request supplies a ``chat_template``: never rendered here (see the module's doc)."""
    return body.get("chat_template") is not None


def refuse_request_template(body: Mapping[str, Any]) -> None:
    if brings_own_template(body):
        raise Unrenderable("the request brings its own chat_template (not rendered: "
                           "vLLM refuses it without --trust-request-chat-template)")


def conversation_of(messages: object, fmt: str) -> list[dict[str, Any]]:
    """vLLM's conversation for text-only messages (``fmt``: ``string`` or ``openai``)."""
    if not isinstance(messages, list) or not messages:
        raise Unrenderable("messages is not a non-empty list")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unrenderable("a message without a role")
        out.append(_message(message, fmt))
    for message in out:
        _parse_tool_call_arguments(message)
    return out


def _message(message: dict[str, Any], fmt: str) -> dict[str, Any]:
    role = message["role"]
    texts = _texts(message.get("content"), fmt)
    if role == "system":
        texts = _strip_billing_header(texts)
    content: Any = texts if fmt == "openai" else "\n".join(
        t if isinstance(t, str) else t["text"] for t in texts)
    result: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = list(message["tool_calls"])
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(content, list):
            result["content"] = "\n".join(p["text"] for p in content)
    for name in ("name", "task"):
        if isinstance(message.get(name), str):
            result[name] = message[name]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _texts(content: object, fmt: str) -> list[Any]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content} if fmt == "openai" else content]
    if not isinstance(content, list):
        raise Unrenderable("message content is neither a string nor a list")
    out: list[Any] = []
    for part in content:
        if isinstance(part, str):
            out.append({"type": "text", "text": part} if fmt == "openai" else part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or part.get("uuid") is not None:
            raise Unrenderable(f"content part of type {kind!r}")
        text = part.get(TEXT_PARTS[kind])
        if text is None:
            continue  # vLLM skips an empty text part
        if not isinstance(text, str):
            raise Unrenderable("a text part's text is not a string")
        if fmt == "openai":
            if set(part) - {"type", "text", TEXT_PARTS[kind]}:
                raise Unrenderable("extra fields on a text part")
            out.append({"type": "text", "text": text})
        else:
            out.append(text)
    return out


def _strip_billing_header(texts: list[Any]) -> list[Any]:
    out = []
    for item in texts:
        text = item if isinstance(item, str) else item["text"]
        if not text.startswith(BILLING_HEADER):
            out.append(item)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(item, str) else {**item, "text": rest})
    return out


def _parse_tool_call_arguments(message: dict[str, Any]) -> None:
    """Tool-call arguments reach templates as objects, as vLLM passes them."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        message.pop("tool_calls")
        return
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise Unrenderable("a tool call that is not a function call")
        raw = function.get("arguments")
        parsed: Any = raw
        if raw and isinstance(raw, str):
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
        function["arguments"] = parsed if raw and isinstance(parsed, dict) else {}


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Developer messages as system ones, then every system message merged into one at the
    front if any is not first (what vLLM does for templates without a developer role)."""
    converted = [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
                 if m["role"] == "developer" else m for m in conversation]
    merge, contents, others = False, list[str](), list[dict[str, Any]]()
    for i, message in enumerate(converted):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(contents)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] for p in content)
        if content:
            contents.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def _knows_developer(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def _plain_request(body: dict[str, Any]) -> None:
    for name in ("prompt_embeds", "truncate_prompt_tokens", "mm_processor_kwargs"):
        if body.get(name) is not None:
            raise Unrenderable(f"{name} changes the tokens in ways not reproduced here")


def _is_ids(value: object) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in value))


@lru_cache(maxsize=32)
def content_format(template: str) -> str:
    """``openai`` when the template loops over a message's content, else ``string``."""
    import jinja2.nodes

    ast = _parse(template)
    if ast is None:
        return "string"
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter | jinja2.nodes.Test) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return "openai"
        if (isinstance(it, jinja2.nodes.Getattr) and it.attr == "content") or (
                isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const)
                and it.arg.value == "content"):
            return "openai"
    return "string"


@lru_cache(maxsize=32)
def _template_variables(template: str) -> frozenset[str]:
    import jinja2.meta

    ast = _parse(template)
    return frozenset() if ast is None else frozenset(jinja2.meta.find_undeclared_variables(ast))


def _parse(template: str) -> Any:
    """The template's syntax tree, or None if it does not compile (vLLM then falls back
    to the string content format, and transformers cannot render it).

    Compiled, never rendered, by a Jinja environment built as transformers builds the one
    it renders with (and vLLM the one it reads template variables with): sandboxed, trimmed,
    with loop controls and the ``{% generation %}`` tag, so a template compiles here exactly
    when it compiles there. Only the tokenizer's own template comes here: a request's
    ``chat_template`` is refused before (:func:`refuse_request_template`)."""
    import jinja2

    env = _parser()
    try:
        env.compile(template)  # an unknown filter or test fails here, as in transformers
        tree = env.parse(template)  # a fresh tree: compiling may optimize the one it makes
    except (jinja2.TemplateError, RecursionError):  # bad syntax, or nesting too deep
        return None
    return tree


@lru_cache(maxsize=1)
def _parser() -> Any:
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: marks the assistant's text in
        transformers' templates; parsed as the call block transformers makes of it."""

        tags = {"generation"}

        def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation_support")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    return jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols])


@lru_cache(maxsize=1)
def _apply_parameters() -> frozenset[str]:
    """The parameters of ``apply_chat_template`` (vLLM lets them through too)."""
    import inspect

    import transformers

    base = getattr(transformers, "PythonBackend", None) or transformers.PreTrainedTokenizerBase
    sig = inspect.signature(base.apply_chat_template)
    return frozenset(p.name for p in sig.parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)) - {"self"}
