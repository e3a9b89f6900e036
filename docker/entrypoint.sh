#!/bin/bash
# Entrypoint of both images: put the CANN environment in effect for the container's main process, then
# exec the command (so it keeps the PID the init process forwards signals to).
#
# ENV lines in the Dockerfile cannot express CANN's set_env.sh scripts (they compute paths and append
# to LD_LIBRARY_PATH, PYTHONPATH and PATH), and sourcing them in a RUN layer affects that layer only.
# Sourcing here makes them apply to `launcher run`, to every rank it starts, and to `docker exec`
# commands started through this entrypoint. In the CUDA image none of the files exist and nothing
# happens.
# No `set -e`: CANN's set_env.sh scripts are not written for it.
set -o pipefail

cann_version="${LAUNCHER_CANN_VERSION:-}"
for env_file in \
    /usr/local/Ascend/ascend-toolkit/set_env.sh \
    "/usr/local/Ascend/cann-${cann_version}/share/info/ascendnpu-ir/bin/set_env.sh" \
    /usr/local/Ascend/nnal/atb/set_env.sh; do
    if [[ -n "${cann_version}" && -f "${env_file}" ]]; then
        # shellcheck disable=SC1090  # CANN's own scripts; their paths are fixed by the base image
        source "${env_file}"
    elif [[ -n "${cann_version}" ]]; then
        echo "entrypoint: ${env_file} not found; the CANN environment may be incomplete" >&2
    fi
done

# LAUNCHER_WRITABLE_DIRS (compose.yaml: /outputs /logs): fail at once, with one message, if the user the
# container runs as cannot write a mounted folder, instead of a traceback from deep inside a run.
for dir in ${LAUNCHER_WRITABLE_DIRS:-}; do
    if [[ ! -d "${dir}" ]]; then
        echo "entrypoint: ${dir} is not mounted (a folder is expected there; see compose.yaml)" >&2
        exit 2
    fi
    if [[ ! -w "${dir}" || ! -x "${dir}" ]]; then
        owner=$(stat -c '%u:%g' "${dir}" 2>/dev/null)
        echo "entrypoint: ${dir} is not writable by uid $(id -u) gid $(id -g) (the host folder is owned by" \
            "${owner:-unknown}, mode $(stat -c '%a' "${dir}" 2>/dev/null)); run with UID/GID of its owner" \
            "(export UID GID=\$(id -g)) or make the host folder writable" >&2
        exit 2
    fi
done

if [[ $# -eq 0 ]]; then
    set -- launcher --help
fi
exec "$@"
