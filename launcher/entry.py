"""The module each rank runs: ``python -m launcher.entry RUN_DIR`` (the ``launcher.entry`` config key's default).

A stable name for ``launcher.rank.entry``, which holds the code, so configs, wrappers that end in
``launcher.entry.main`` and the docs keep working.
"""

import sys

from launcher.rank.entry import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
