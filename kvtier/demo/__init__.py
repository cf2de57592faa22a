"""The locally built demo model used by ``kvtier serve`` without ``--model`` and by tests."""

from __future__ import annotations

from kvtier.demo.model import DEMO_NAME, DemoRecipe, demo_model_path, ensure_demo_model

__all__ = ["DEMO_NAME", "DemoRecipe", "demo_model_path", "ensure_demo_model"]
