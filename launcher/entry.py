"""The module each rank runs: ``python -m launcher.entry RUN_DIR`` (the ``launcher.entry`` config key's default).

A stable name for ``launcher.rank.entry``, which holds the code, so configs, the docs and wrappers written
against it keep working: a wrapper (``benchmarks/bench_entry.py`` is one) ends in ``launcher.entry.main`` and
may use ``write_error_file`` and ``LAUNCH_FILE`` as before.
"""

import sys

from launcher.rank.entry import LAUNCH_FILE, main, write_error_file

__all__ = ["LAUNCH_FILE", "main", "write_error_file"]

if __name__ == "__main__":
    sys.exit(main())
