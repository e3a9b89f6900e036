#!/usr/bin/env bash
# The whole test suite on a CPU machine: sets up .venv first, then runs pytest.
#   bash scripts/test.sh            (extra arguments go to pytest, e.g. -k config)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup-env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider --timeout 900 "$@"
