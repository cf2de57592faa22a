"""``kvtier plan``: the sizing discipline as a command.

Separate the model-weights budget, the runtime workspace and the KV budget on the device; size
the host tier from what the host can spare (never from a snapshot of free memory), and let a
trace decide how much of that is worth holding. :mod:`~kvtier.plan.model` reads the model,
:mod:`~kvtier.plan.budget` does the arithmetic, :mod:`~kvtier.plan.traffic` answers the four
questions of a trace, :mod:`~kvtier.plan.planner` makes the server config.
"""

from __future__ import annotations

from kvtier.plan.budget import CPU_OFFLOAD_NOTE, DeviceInputs, HostInputs
from kvtier.plan.model import ModelShape, read_model
from kvtier.plan.planner import DiskInputs, Plan, make_plan

__all__ = ["CPU_OFFLOAD_NOTE", "DeviceInputs", "DiskInputs", "HostInputs", "ModelShape",
           "Plan", "make_plan", "read_model"]
