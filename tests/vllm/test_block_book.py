"""The connector's block book: bounded, and what it announced stays announced."""

from __future__ import annotations

from kvtier.keys import ChunkKey
from kvtier.vllm.block_book import BlockBook, ChunkBlocks


def _blocks(n: int) -> ChunkBlocks:
    from array import array

    return ChunkBlocks((bytes([n]),), None, array("l", [n]), 16)


def test_the_block_book_is_bounded_and_keeps_what_was_announced() -> None:
    a, b, c = (ChunkKey(bytes([n]) * 32) for n in range(3))
    book = BlockBook(2)
    book.write(a, _blocks(1))
    first = book.get(a)
    assert first is not None
    first.held.add("arena")
    book.write(a, _blocks(2))  # written again: still announced in the arena
    again = book.get(a)
    assert again is not None and again.held == {"arena"} and again.tokens.tolist() == [2]
    book.write(b, _blocks(3))
    book.write(c, _blocks(4))
    assert a not in book and len(book) == 2 and book.forgotten_held == 1
    assert list(book.held()) == []
