"""``kvtier.tables``: every CLI table's one look, plain text wherever it is printed."""

from __future__ import annotations

import pytest

from kvtier.tables import table


def test_names_left_figures_right_two_spaces_apart() -> None:
    text = table(["tier", "hits", "ratio"], [["host", "1,024", "50.0%"], ["disk", "7", "-"]])
    assert text.splitlines() == [
        "tier   hits  ratio",
        "host  1,024  50.0%",
        "disk      7      -",
    ]


def test_align_indent_and_no_header() -> None:
    text = table(None, [["  usable", "72.0GiB", "= 80GiB x 0.9"], ["  - weights", "15GiB", ""]],
                 align="lrl", indent="> ")
    assert text.splitlines() == [
        ">   usable     72.0GiB  = 80GiB x 0.9",
        ">   - weights    15GiB",
    ]


def test_no_trailing_spaces_and_no_terminal_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("COLUMNS", "20")
    text = table(["config", "description"], [["a", "x" * 60], ["long name", ""]], align="ll")
    assert "\x1b" not in text
    assert all(line == line.rstrip() for line in text.splitlines())
    assert text.splitlines()[1] == "a          " + "x" * 60  # COLUMNS does not wrap it


def test_hostile_cells_are_printed_as_written() -> None:
    """A client-chosen name with rich markup or emoji codes is text, never markup."""
    cells = ["[bold red]x[/]", ":smile:", "[/]", "[link=http://evil]y"]
    text = table(["name"], [[c] for c in cells])
    assert text.splitlines()[1:] == cells


def test_a_given_width_wraps_cells_to_fit() -> None:
    text = table(["name", "note"], [["a", "word " * 20]], align="ll", width=30)
    assert len(text.splitlines()) > 2 and max(len(line) for line in text.splitlines()) <= 30


def test_an_empty_table_is_its_header() -> None:
    assert table(["a", "b"], []) == "a  b"


def test_mismatched_rows_and_alignments_are_refused() -> None:
    with pytest.raises(ValueError, match="a row has 1 cells, the table 2 columns"):
        table(["a", "b"], [["only one"]])
    with pytest.raises(ValueError, match="one of l, r, c for each of 2 columns"):
        table(["a", "b"], [["x", "y"]], align="lx")
    with pytest.raises(ValueError, match="for each of 2 columns"):
        table(["a", "b"], [["x", "y"]], align="l")
