#!/usr/bin/env bash
# The test suite on a CPU machine: sets up .venv first, then runs pytest.
#   bash scripts/test.sh                 everything (what CI runs; about 43 min on 2 cores with CI's engine)
#   bash scripts/test.sh --fast          all but the tests marked slow, which train the tiny model through
#                                        real processes (about 4 min on 2 cores): the run for each edit
#   bash scripts/test.sh --fast -k stop  extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

select=()
if [[ ${1:-} == --fast ]]; then
    shift
    select=(-m "not slow")
fi
bash scripts/setup-env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest -q -p no:cacheprovider --timeout 900 "${select[@]}" "$@"
