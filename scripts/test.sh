#!/usr/bin/env bash
# The test suite on a CPU machine: sets up .venv first, then runs pytest.
#   bash scripts/test.sh                 everything (what CI runs; about 40 min on 2 cores with CI's engine)
#   bash scripts/test.sh --fast          all but the tests marked slow, which train the tiny model through
#                                        real processes (about 2.5 min on a quiet 2-core machine; README):
#                                        the run for each edit
#   bash scripts/test.sh --fast -k stop  extra arguments go to pytest (give no -m: the script selects by marker)
#
# Two passes: the tests that need no Docker engine in TEST_WORKERS pytest-xdist workers (default 2; 0 runs them
# in pytest's own process; most tests wait on one single-threaded Python process at a time), then the engine's
# tests (markers docker, docker_npu, slurm: one engine, its images and the Slurm cluster, shared) in one process,
# in file order. Without an engine (LAUNCHER_DOCKER_TESTS unset) the second pass reports them skipped. The exit
# code is the first failing pass's; an interrupted first pass (Ctrl-C, CI's time limit) ends the script there.
set -euo pipefail
cd "$(dirname "$0")/.."

base=""
if [[ ${1:-} == --fast ]]; then
    shift
    base="not slow and "
fi
engine="(docker or docker_npu or slurm)"
# where the engine's tests live (tests/test_architecture.py checks that no other module has one): the second pass
# collects only these, not the whole suite again, unless the arguments name paths of their own
engine_paths=(tests/containers tests/slurm)
for arg in "$@"; do
    if [[ -e ${arg%%::*} ]]; then
        engine_paths=()
        break
    fi
done
bash scripts/setup-env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
rc=0
python -m pytest -q -p no:cacheprovider --timeout 900 -n "${TEST_WORKERS:-2}" -m "${base}not ${engine}" "$@" || rc=$?
if ((rc == 0 || rc == 1)); then # not interrupted, no usage error: the engine's pass reports too
    second=0
    python -m pytest -q -p no:cacheprovider --timeout 900 -m "${base}${engine}" \
        ${engine_paths[@]+"${engine_paths[@]}"} "$@" || second=$?
    ((second == 5)) && second=0 # an argument that selects none of the engine's tests is no failure
    ((rc != 0)) || rc=$second
fi
exit "$rc"
