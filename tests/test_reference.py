"""The reference pages (docs/reference/) are generated from the code and must match it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import ServerConfig, TierConfig
from kvtier.errors import ConfigError
from kvtier.reference import COMMAND, PAGES, Unavailable, generate, stale, write
from kvtier.reference.__main__ import UNAVAILABLE, main

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "reference"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    try:
        return generate()
    except Unavailable as exc:  # e.g. no torch: `kvtier bench gpu` cannot be read
        pytest.skip(str(exc))


def test_committed_pages_match_the_code_on_another_machine(tmp_path: Path) -> None:
    """Another home, runtime folder and working folder: the same pages, byte for byte."""
    env = {**os.environ, "HOME": str(tmp_path / "home"), "XDG_RUNTIME_DIR": str(tmp_path / "r"),
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "kvtier.reference", "--check", "--out",
                          str(COMMITTED)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode == UNAVAILABLE:
        pytest.skip(out.stderr)
    assert out.returncode == 0, (
        f"docs/reference/ differs from the code; regenerate with: {COMMAND}\n{out.stderr}")


def test_check_names_a_stale_page_and_the_command(tmp_path: Path, pages: dict[str, str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert write(tmp_path, pages) == sorted(PAGES)
    assert stale(tmp_path, pages) == [] and write(tmp_path, pages) == []
    (tmp_path / "metrics.md").write_text(pages["metrics.md"].replace("kvtier_hits", "hits"))
    (tmp_path / "cli.md").unlink()
    assert main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "cli.md: differs" in err and "metrics.md: differs" in err and "config.md" not in err
    assert f"regenerate with: {COMMAND}" in err


def test_pages_have_one_title_and_link_only_to_each_other(pages: dict[str, str]) -> None:
    for name, text in pages.items():
        assert len(re.findall(r"^# ", text, re.M)) == 1 and text.startswith("# "), name
        for target in re.findall(r"\]\(([^)]*)\)", text):
            assert target in PAGES, f"{name}: link to {target}"
        assert text.endswith("\n") and "\n\n\n" not in text, name


def test_pages_hold_nothing_of_this_machine(pages: dict[str, str]) -> None:
    for name, text in pages.items():
        for machine in (str(Path.home()), os.getcwd(), str(ROOT)):
            assert machine not in text, f"{name} shows {machine}"
        assert not re.search(r"default: \d+ ?[MG]iB, 1/\d", text), name


def test_every_command_is_listed_with_its_options(pages: dict[str, str]) -> None:
    cli = pages["cli.md"]
    for command in ("kvtier server", "kvtier route", "kvtier bench sweep",
                    "kvtier trace simulate", "kvtier plan", "kvtier verify", "kvtier serve"):
        assert f"\n## {command}\n" in cli, command
    sweep = cli.split("\n## kvtier bench sweep\n")[1].split("\n## ")[0]
    assert "| `--repeat K` | `1` |" in sweep


def test_config_shows_the_bounds_the_parser_enforces(pages: dict[str, str]) -> None:
    """One declaration: the page says [1, 64], the parser and a struct built in code refuse 0."""
    config = pages["config.md"]
    assert "| `io_threads` | integer | `2` | in [1, 64] |" in config
    assert "| `lease_ttl_s` | number | `30.0` | positive |" in config
    assert "| `namespace_bytes` | size or null | `null` |" in config
    with pytest.raises(ConfigError, match=r"^tiers\[0\]\.io_threads must be in \[1, 64\], got 0"):
        ServerConfig.from_dict({"tiers": [{"type": "disk", "capacity_bytes": 1 << 20,
                                           "io_threads": 0}]})
    with pytest.raises(ConfigError, match=r"^io_threads must be in \[1, 64\], got 65$"):
        TierConfig(type="disk", capacity_bytes=1 << 20, io_threads=65)


def test_every_tier_type_has_its_options_documented(pages: dict[str, str]) -> None:
    from kvtier.reference.config_page import TIER_OPTIONS
    from kvtier.tiers import TIERS

    assert sorted(TIER_OPTIONS) == sorted(TIERS)
    for tier in TIERS:
        assert f"\n## Tier options: {tier}\n" in pages["config.md"]


def test_every_metric_is_listed_with_its_labels(pages: dict[str, str]) -> None:
    from prometheus_client import generate_latest

    from kvtier.metrics import StoreMetrics
    from kvtier.router.metrics import RouterMetrics

    metrics = pages["metrics.md"]
    for registry in (StoreMetrics().registry, RouterMetrics().registry):
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE ") and not line.split()[2].endswith("_created"):
                name, kind = line.split()[2:4]
                shown = name.removesuffix("_total") + ("_total" if kind == "counter" else "")
                assert f"| `{shown}` | {kind} |" in metrics, shown
    assert "| `kvtier_bytes_total` | counter | `tier`, `direction` |" in metrics
    assert "| `kvtier_stack_part_state` | gauge | `part`, `state` |" in metrics


def test_a_command_that_cannot_be_imported_here_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without torch, `kvtier bench gpu` is a stand-in: a page with that hole is refused."""
    monkeypatch.setitem(sys.modules, "kvtier.bench.gpu", None)  # import fails: ImportError
    assert main(["--out", str(tmp_path)]) == UNAVAILABLE
    assert "cannot document `kvtier bench gpu` here" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
