from __future__ import annotations

import sys

from kvtier.cli import main

sys.exit(main())
