"""The locally built demo model used by ``kvtier serve`` without ``--model`` and by tests."""

from __future__ import annotations

from kvtier.demo.model import DemoRecipe, demo_model_path, ensure_demo_model

__all__ = ["DemoRecipe", "demo_model_path", "ensure_demo_model"]
