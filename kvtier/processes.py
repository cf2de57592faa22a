"""Whether a process still exists: used to clean up what dead servers and writers left."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True if ``pid`` names a live process (also one of another user); never signals it."""
    if pid <= 0:
        return False  # 0 and negatives name process groups, not a process
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
