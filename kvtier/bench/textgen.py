"""Deterministic synthetic prose of a given length in tokens.

Sentences of common English words drawn from a seeded :class:`random.Random`: the same seed
gives the same text, different seeds give text that shares no prefix beyond a word or two
(so two users' histories never look like one shared prefix to a cache).
"""

from __future__ import annotations

import random

from kvtier.bench.tokens import TokenCounter

_WORD_LIST = """
the of and to in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there one all we their has been if more when will would
who so no out up into do time can only other new some could these two may first then any
like now my such make over our even most me state after also made many did must before back
see through way where get much go well your know should down work year because come people
just say each those take day good how long little very own world use still place great
between under never last while might here part point number think system general life high
give again hand small show water found better head light question answer story river city
market garden window morning evening music paper letter table money order power field
village engine station bridge island forest mountain winter summer harbor library kitchen
teacher doctor farmer sailor painter writer reader student friend family brother sister
"""
WORDS = tuple(_WORD_LIST.split())


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
    return " ".join(words).capitalize() + "."


def prose(rng: random.Random, words: int) -> str:
    out: list[str] = []
    count = 0
    while count < words:
        s = sentence(rng)
        out.append(s)
        count += s.count(" ") + 1
    return " ".join(out)


def text_of(counter: TokenCounter, tokens: int, rng: random.Random, lead: str = "") -> str:
    """``lead`` followed by prose, cut to ``tokens`` tokens in all (0 gives '')."""
    if tokens <= 0:
        return ""
    words = max(8, tokens)
    while True:
        text = (lead + " " if lead else "") + prose(rng, words)
        if counter.count(text) >= tokens:
            return counter.cut(text, tokens)
        words *= 2
