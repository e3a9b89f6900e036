"""A rank entry that runs ``launcher.entry`` as if the run config said ``launcher.log_examples: true``.

The control of ``tests/test_data_stats.py::test_training_log_carries_no_training_text`` while the
launcher section has no ``log_examples`` key: it shows the sentinel does reach the log when the
protection is off, so the test can fail.
"""

from __future__ import annotations

import sys

import launcher.privacy
from launcher.entry import main

launcher.privacy.log_examples_wanted = lambda run_dir: True  # entry imports it at call time

if __name__ == "__main__":
    sys.exit(main())
