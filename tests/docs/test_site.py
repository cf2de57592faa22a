"""The documentation site builds with ``mkdocs build --strict`` (mkdocs.yml's ``validation``
turns a broken link, a missing anchor and a page left out of the navigation into errors), and
its pages stay short enough to read: docs/benchmarks.md under 300 lines, no guide over 400.

``make test`` runs this, so a docs change that breaks the site fails CI like a code change."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Material for MkDocs prints a notice about its successor on every build otherwise.
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
DOCS = ROOT / "docs"
GUIDE_MAX_LINES = 400
BENCHMARKS_MAX_LINES = 300
# Generated from the code, as long as the code makes them: not a guide.
GENERATED = ("reference/",)


def build(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` in ``cwd`` (where its mkdocs.yml is)."""
    if find_spec("mkdocs") is None or find_spec("material") is None:
        pytest.fail("the docs site needs the docs extra: pip install -e '.[docs]' (make setup)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", *args], cwd=cwd,
                          env=ENV, capture_output=True, text=True, timeout=300, check=False)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = build(ROOT, "--site-dir", str(tmp_path / "site"))
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-6000:]}"
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "operations" / "index.html").is_file()


def test_a_broken_link_fails_the_build(tmp_path: Path) -> None:
    """The strict build is only worth running if it catches what it is for: a copy of the
    site with a link to a missing page, one to a missing anchor and a page left out of the
    navigation must fail, naming each."""
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "CHANGELOG.md").symlink_to(ROOT / "CHANGELOG.md")  # docs/changelog.md includes it
    bad = tmp_path / "bad"
    bad.mkdir()
    for page in DOCS.rglob("*"):
        target = bad / page.relative_to(DOCS)
        if page.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.symlink_to(page)
    (bad / "index.md").unlink()
    (bad / "index.md").write_text((DOCS / "index.md").read_text()
                                  + "\n[gone](no-such-page.md) [lost](server.md#no-such-anchor)\n")
    (copy / "mkdocs.yml").write_text(f"INHERIT: {ROOT / 'mkdocs.yml'}\ndocs_dir: {bad}\n"
                                     f"site_dir: {tmp_path / 'site'}\n")
    (bad / "orphan.md").write_text("# In no navigation\n")
    done = build(copy)
    assert done.returncode != 0
    for named in ("no-such-page.md", "no-such-anchor", "orphan.md"):
        assert named in done.stderr, done.stderr[-3000:]


def test_guides_stay_short() -> None:
    lines = {str(p.relative_to(DOCS)): len(p.read_text().splitlines())
             for p in DOCS.rglob("*.md") if not str(p.relative_to(DOCS)).startswith(GENERATED)}
    assert lines["benchmarks.md"] < BENCHMARKS_MAX_LINES
    long = {page: n for page, n in lines.items() if n > GUIDE_MAX_LINES}
    assert long == {}, f"pages over {GUIDE_MAX_LINES} lines: split them by topic"


def test_the_readmes_links_into_the_docs_resolve() -> None:
    """README.md is outside the site, so the strict build does not read it: its links to pages
    and their sections are checked here, with the site's own anchors (GitHub's spelling)."""
    from pymdownx.slugs import slugify

    slug = slugify(case="lower")
    links = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#\s]*)(?:#([^)\s]+))?\)",
                       (ROOT / "README.md").read_text())
    assert len(links) >= 10
    broken = []
    for path, anchor in links:
        target = ROOT / path
        if not target.is_file():
            broken.append(path)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.MULTILINE)
            if anchor not in {slug(h, "-") for h in headings}:
                broken.append(f"{path}#{anchor}")
    assert broken == []
