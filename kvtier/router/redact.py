"""Credentials in backend and node-server URLs (``http://user:pass@host:port``), kept out of
everything the router shows.

The requests themselves use the URL as given (aiohttp takes the user and password off the
URL and sends them as HTTP Basic auth). Everywhere a URL is *shown* — a backend's name, the
``backend`` and ``server`` labels of ``/metrics``, the ``X-Kvtier-Backend`` header, log lines,
error messages — it is the redacted form ``http://***@host:port``. A :class:`Scrubber` also
replaces the credentials wherever else they could turn up in a text (an exception's message),
and :class:`ScrubFilter` applies it to every record of the ``kvtier.router`` logger.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit, urlunsplit

MASK = "***"


def userinfo(url: str) -> str | None:
    """The ``user:pass`` part of ``url`` as written, or None."""
    netloc = urlsplit(url).netloc
    info, at, _host = netloc.rpartition("@")
    return info if at else None


def redact_url(url: str) -> str:
    """``url`` with its user and password replaced by ``***``; unchanged without them."""
    parts = urlsplit(url)
    _info, at, host = parts.netloc.rpartition("@")
    if not at:
        return url
    return urlunsplit(parts._replace(netloc=f"{MASK}@{host}"))


class Scrubber:
    """Replaces the credentials of the given URLs (as written and percent-decoded) in a text."""

    def __init__(self, urls: Iterable[str | None]) -> None:
        found: set[str] = set()
        for url in urls:
            info = userinfo(url) if url else None
            if not info:
                continue
            found.add(info)
            found.add(unquote(info))
            _user, colon, password = info.partition(":")
            if colon and password:
                found.update({password, unquote(password)})
        # longest first, so a password is not half-replaced by its own user:password
        self._secrets = sorted((s for s in found if s), key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    @property
    def active(self) -> bool:
        return bool(self._secrets)


class ScrubFilter(logging.Filter):
    """Scrubs a record's formatted message (and its traceback text) before any handler sees
    it."""

    def __init__(self, scrub: Scrubber) -> None:
        super().__init__()
        self.scrub = scrub

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = self.scrub(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.scrub(record.exc_text)
        return True
