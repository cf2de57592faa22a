"""Encoding a conversation again each turn without tokenizing all of it again.

A chat's rendered prompt grows turn by turn: this turn's text starts with the last turn's
(less its generation prompt). Tokenizing the whole of it on every request costs the router
about 0.4 µs a character in the tokenizer's pre-tokenizer alone (7-14 ms for a 4,000-token
conversation on the development machine, on the cores the engines use), where round robin
spends nothing.

:class:`SegmentEncoder` cuts the text into segments at line breaks that stand between two
non-blank characters, each segment at least ``min_chars`` long, and keeps each segment's
tokens (by a digest of its text) in an LRU bounded by ``max_tokens``. A turn then encodes only
what it has not seen: its new messages and the segment that held the last turn's end. The
cuts depend only on the text before them, so two turns of one conversation cut their common
beginning alike, and a system prompt or document many conversations share is reused by all.

Why a cut there is exact: byte-level BPE merges within the pieces its pre-tokenizer splits
the text into, and the pre-tokenizers of GPT-2, Llama 3, Qwen and the demo model never join a
line break with a non-blank character after it, so the pieces of the whole text are the pieces
of its segments. What is known to break that is refused up front (:func:`unsafe_reason`): a
byte-level pre-tokenizer that adds a prefix space (it would add one to every segment), an
added token with ``lstrip`` (it swallows the line break before it) or with a cut point inside
it. Other tokenizers may differ too (a SentencePiece "▁" prefix on every segment, a normalizer
that reads across lines), so the encoder checks itself: its first :data:`CHECK_FIRST`
segmented encodings and one in :data:`CHECK_EVERY` afterwards are also encoded whole, and one
difference turns segments off for that tokenizer for good (logged once) and answers with the
whole encoding. A wrong token could only misroute
a request (the engine computes its own keys); it is never served as KV.

Encoding is in two steps so that the router can do the cheap ones on its event loop:
:meth:`SegmentEncoder.prepare` cuts and looks up (no tokenizer; its cost grows with the
text's length only), :meth:`Prepared.finish` encodes what was not kept;
:attr:`Prepared.cost_chars` says how much that is beforehand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

log = logging.getLogger("kvtier.router")

MIN_CHARS = 1024
"""The shortest segment, in characters: fewer, larger pieces to look up and encode."""
MAX_TOKENS = 4_000_000
"""What one tokenizer keeps, in tokens plus :data:`ENTRY_COST` per segment: at most ~16 MiB
of token ids and ~240 bytes of bookkeeping for each of at most 62,500 segments (~31 MiB)."""
ENTRY_COST = 64
"""A kept segment's bookkeeping (digest, dict slot, array header), counted as tokens."""
LARGEST_SHARE = 8
"""No one segment takes more than 1/8 of :data:`MAX_TOKENS`: one huge prompt cannot empty
what everyone else's conversations keep."""
CHECK_FIRST = 8
CHECK_EVERY = 64
HEAD_TRIES = 16
"""Of the first piece not kept, the last this many cut points are tried as the end of an
earlier text's last piece (a conversation's previous turn ends a few lines before)."""

_CUT = re.compile(r"\n(?<=\S\n)(?=\S)")
"""A line break between two non-blank characters: a cut goes right after it."""
_INSIDE = re.compile(r"\n\S")


class SegmentEncoder:
    """``encode`` (text to token ids, no special tokens added), reusing the tokens of the
    segments it has seen. Thread-safe: the router encodes in worker threads."""

    def __init__(self, encode: Callable[[str], list[int]], name: str, *,
                 min_chars: int = MIN_CHARS, max_tokens: int = MAX_TOKENS,
                 unsafe: str | None = None) -> None:
        self._encode = encode
        self.name = name
        self.min_chars = min_chars
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._kept = _Tokens(max_tokens)
        self._ends = _Tokens(max_tokens // LARGEST_SHARE)
        """The last pieces of recent texts, where their conversations go on: a next turn's
        piece that starts with one encodes only the rest. Bounded by an eighth of
        ``max_tokens``, apart from :attr:`_kept`."""
        self._calls = 0
        self.enabled = unsafe is None
        """False when the tokenizer is known not to cut cleanly (``unsafe`` says why), or
        once a check found a difference: every text is then encoded whole."""
        if unsafe is not None:
            log.info("tokenizer %s: prompts are encoded whole (%s)", name, unsafe)
        self.encoded_chars = 0
        """Characters handed to the tokenizer by the segmented path (checks not counted)."""
        self.reused_chars = 0
        """Characters whose tokens came from a kept segment."""

    def __call__(self, text: str) -> list[int]:
        return list(self.prepare(text).finish())

    def prepare(self, text: str) -> Prepared:
        """``text`` cut and looked up, nothing encoded yet: :attr:`Prepared.cost_chars` says
        how much of it the tokenizer still has to encode (the router does that little on
        its event loop, more in a thread), :meth:`Prepared.finish` encodes it."""
        if not self.enabled or len(text) < 2 * self.min_chars:
            return Prepared(self, text, None, check=False)
        with self._lock:
            self._calls += 1
            check = self._calls <= CHECK_FIRST or self._calls % CHECK_EVERY == 0
        segments = self.segments(text)
        digests = [hashlib.blake2b(segment.encode("utf-8", "surrogatepass"),
                                   digest_size=16).digest() for segment in segments]
        with self._lock:
            pieces = [_Piece(segment, digest, self._touch(digest))
                      for segment, digest in zip(segments, digests, strict=True)]
        first = next((i for i, p in enumerate(pieces) if p.kept is None), None)
        if first is not None:
            pieces[first] = self._with_head(pieces[first])
        return Prepared(self, text, pieces, check)

    def _with_head(self, piece: _Piece) -> _Piece:
        """``piece`` with the tokens of the longest earlier last piece it starts with, that
        ends at a cut point (:data:`_CUT`: what comes after it encodes alone), if any. One
        pass of the hash over the piece, a copy of its state at each of the last
        :data:`HEAD_TRIES` cut points."""
        points = [m.end() for m in _CUT.finditer(piece.text)][-HEAD_TRIES:]
        if not points:
            return piece
        h = hashlib.blake2b(digest_size=16)
        done, digests = 0, []
        for point in points:
            h.update(piece.text[done:point].encode("utf-8", "surrogatepass"))
            digests.append((point, h.copy().digest()))
            done = point
        with self._lock:
            for point, digest in reversed(digests):
                head = self._ends.touch(digest)
                if head is not None:
                    return _Piece(piece.text, piece.digest, None, head, point)
        return piece

    def finish(self, prepared: Prepared) -> Sequence[int]:
        """The tokens of a text :meth:`prepare` cut: the pieces not kept encoded (and kept),
        the whole text too when a check is due. Segmented, they are an ``array("i")``: what
        the kept pieces are, copied without a Python int each."""
        if prepared.pieces is None:
            return self._encode(prepared.text)
        tokens = self._segmented(prepared.pieces)
        if not prepared.check:
            return tokens
        whole = self._encode(prepared.text)
        if array("i", whole) != tokens:
            self._turn_off()
        return whole

    def segments(self, text: str) -> list[str]:
        """``text`` cut where :data:`_CUT` allows, each piece but the last ≥ ``min_chars``."""
        cuts = [0]
        # one search per cut, each from a segment's length past the last: the text between
        # is never scanned (a conversation's history is one or two searches, not thousands
        # of candidate line breaks)
        while (match := _CUT.search(text, cuts[-1] + self.min_chars - 1)) is not None:
            cuts.append(match.end())
        cuts.append(len(text))
        return [text[a:b] for a, b in pairwise(cuts) if b > a]

    def _segmented(self, pieces: list[_Piece]) -> array[int]:
        out, last = array("i"), array("i")
        for i, piece in enumerate(pieces):
            with self._lock:
                # kept since it was prepared (by another request, or here)?
                kept = piece.kept if piece.kept is not None else self._touch(piece.digest)
                if kept is not None:
                    self.reused_chars += len(piece.text)
            if kept is None:
                if piece.head is None:
                    kept = array("i", self._encode(piece.text))
                else:
                    kept = piece.head + array("i", self._encode(piece.text[piece.head_chars:]))
                # a last piece shorter than a segment is where the next turn goes on: never
                # asked for again whole, not kept (but remembered as an end, below)
                keep = i < len(pieces) - 1 or len(piece.text) >= self.min_chars
                self._keep(piece.digest, kept, len(piece.text) - piece.head_chars,
                           piece.head_chars, keep)
            out.extend(kept)
            last = kept
        self._end(pieces[-1].digest, last)
        return out

    def _end(self, digest: bytes, tokens: array[int]) -> None:
        """Remember a text's last piece (the lock not held)."""
        with self._lock:
            if self.enabled and self._ends.touch(digest) is None:
                self._ends.add(digest, tokens)

    def _touch(self, digest: bytes) -> array[int] | None:
        """The kept tokens of a segment, now the most recently used (the lock held)."""
        return self._kept.touch(digest)

    def _keep(self, digest: bytes, tokens: array[int], chars: int, reused: int,
              keep: bool) -> None:
        with self._lock:
            self.encoded_chars += chars
            self.reused_chars += reused
            if keep and self.enabled:
                self._kept.add(digest, tokens)

    def _turn_off(self) -> None:
        with self._lock:
            was, self.enabled = self.enabled, False
            self._kept.clear()
            self._ends.clear()
        if was:
            log.warning("tokenizer %s: encoding a prompt in segments gave other tokens than "
                        "encoding it whole; prompts are encoded whole from now on", self.name)

    def stats(self) -> dict[str, int | bool]:
        with self._lock:
            return {"enabled": self.enabled, "segments": len(self._kept),
                    "cost": self._kept.cost, "ends": len(self._ends),
                    "ends_cost": self._ends.cost, "encoded_chars": self.encoded_chars,
                    "reused_chars": self.reused_chars}


class _Tokens:
    """Token arrays by digest, least recently used out first, their tokens plus
    :data:`ENTRY_COST` each at most ``budget``; an entry costing more than an eighth of it
    is not added (:data:`LARGEST_SHARE`). Not locked: its encoder's lock is held."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.cost = 0
        self._items: OrderedDict[bytes, array[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._items

    def touch(self, digest: bytes) -> array[int] | None:
        """The tokens under ``digest``, now the most recently used; None if absent."""
        tokens = self._items.get(digest)
        if tokens is not None:
            self._items.move_to_end(digest)
        return tokens

    def add(self, digest: bytes, tokens: array[int]) -> None:
        """Keep ``tokens`` under ``digest`` unless it is kept already (its place unchanged)
        or costs too much."""
        cost = len(tokens) + ENTRY_COST
        if cost > self.budget // LARGEST_SHARE or digest in self._items:
            return
        self._items[digest] = tokens
        self.cost += cost
        while self.cost > self.budget:
            _, dropped = self._items.popitem(last=False)
            self.cost -= len(dropped) + ENTRY_COST

    def clear(self) -> None:
        self._items.clear()
        self.cost = 0


@dataclass(frozen=True)
class _Piece:
    text: str
    digest: bytes
    kept: array[int] | None
    """Its tokens, if they were kept when the text was prepared."""
    head: array[int] | None = None
    """Else the tokens of an earlier text's last piece it starts with (:attr:`head_chars`
    characters, ending at a cut point), if one was remembered."""
    head_chars: int = 0


class Prepared:
    """A text cut into segments, with the tokens kept of them; :meth:`finish` encodes the
    rest."""

    def __init__(self, encoder: SegmentEncoder, text: str, pieces: list[_Piece] | None,
                 check: bool) -> None:
        self.encoder = encoder
        self.text = text
        self.pieces = pieces
        """None: the text is encoded whole (short, or segments are off)."""
        self.check = check
        """Also encode it whole, and compare (:data:`CHECK_FIRST`, :data:`CHECK_EVERY`)."""

    @property
    def cost_chars(self) -> int:
        """Characters the tokenizer has yet to encode."""
        if self.pieces is None:
            return len(self.text)
        new = sum(len(p.text) - p.head_chars for p in self.pieces if p.kept is None)
        return new + (len(self.text) if self.check else 0)

    def finish(self) -> Sequence[int]:
        return self.encoder.finish(self)


def unsafe_reason(tokenizer: Any) -> str | None:
    """Why ``tokenizer`` (a transformers tokenizer) is known not to cut cleanly at
    :data:`_CUT`, or None. Reads its backend's pre-tokenizer and its added tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            doc = json.loads(backend.to_str())
        except (ValueError, TypeError, AttributeError):
            return "its tokenizer.json cannot be read"
        if _adds_prefix_space(doc.get("pre_tokenizer")):
            return "its pre-tokenizer adds a prefix space"
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for token in added.values():
        content = str(getattr(token, "content", token))
        if getattr(token, "lstrip", False):
            return f"added token {content!r} strips the blanks before it"
        if _INSIDE.search(content):  # a cut could fall inside the token
            return f"added token {content!r} holds a line break before a non-blank"
    return None


def _adds_prefix_space(node: Any) -> bool:
    if isinstance(node, dict):
        if node.get("add_prefix_space") is True:
            return True
        if node.get("prepend_scheme") in ("always", "first"):
            return True
        return any(_adds_prefix_space(v) for v in node.values())
    if isinstance(node, list):
        return any(_adds_prefix_space(v) for v in node)
    return False
