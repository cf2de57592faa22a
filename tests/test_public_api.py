"""The public names of ``kvtier`` are importable, sorted, and none imports vLLM."""

from __future__ import annotations

import kvtier


def test_all_is_sorted_and_importable() -> None:
    assert kvtier.__all__ == sorted(kvtier.__all__)
    for name in kvtier.__all__:
        assert getattr(kvtier, name) is not None, name


def test_version_matches_the_package_metadata() -> None:
    from importlib import metadata

    assert kvtier.__version__ == metadata.version("kvtier")
