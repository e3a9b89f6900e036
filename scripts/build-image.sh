#!/usr/bin/env bash
# Build an image without a public registry, in one command:
#
#   bash scripts/build-image.sh cpu                   # local Debian base image + wheelhouse/cpu
#   REGISTRY_MIRROR=mirror.example.com bash scripts/build-image.sh npu   # base image through a mirror
#   WHEELHOUSE=npu-aarch64 bash scripts/build-image.sh npu               # another wheelhouse folder
#
# TARGET is cpu (service train-cpu), cuda (train-cuda) or npu (train). In order:
# 1. the wheelhouse (wheelhouse/$WHEELHOUSE, default wheelhouse/TARGET) is checked for the image's platform
#    (this machine's, Python 3.11) before anything is built; every wheel it lacks is named, with the
#    command that makes it on a connected machine (docker/wheelhouse.py);
# 2. cpu without REGISTRY_MIRROR or CPU_BASE_IMAGE: the local Debian base image is made
#    (scripts/docker-base-image.sh, from the machine's Debian mirror); cuda and npu need their base image
#    from REGISTRY_MIRROR, or already loaded (`docker load`) under the name CUDA_BASE_IMAGE / CANN_IMAGE;
# 3. `docker compose build` of the service, offline from the wheelhouse (pip --no-index).
set -euo pipefail
cd "$(dirname "$0")/.."

die() {
    echo "build-image: $*" >&2
    exit 2
}

target=${1:-}
case "$target" in
    cpu) service=train-cpu lock=requirements-cpu.lock profile=(--profile cpu) ;;
    cuda) service=train-cuda lock=requirements-cuda.lock profile=(--profile cuda) ;;
    npu) service=train lock=requirements.lock profile=() ;;
    *)
        sed -n '2,15p' "$0" >&2
        die "TARGET must be cpu, cuda or npu (got '${target}')"
        ;;
esac
export WHEELHOUSE=${WHEELHOUSE:-$target}
python=${PYTHON:-python3}

[[ -d wheelhouse/$WHEELHOUSE ]] || die "no folder wheelhouse/$WHEELHOUSE: make it on a connected machine with" \
    "'python3 docker/wheelhouse.py download $lock wheelhouse/$WHEELHOUSE --platform $(uname -m)' and copy it here"
"$python" docker/wheelhouse.py check "$lock" "wheelhouse/$WHEELHOUSE" --platform "$(uname -m)" || exit 2

if [[ $target == cpu && -z ${REGISTRY_MIRROR:-} && -z ${CPU_BASE_IMAGE:-} ]]; then
    export CPU_BASE_IMAGE=local/debian-python:bookworm
    bash scripts/docker-base-image.sh "$CPU_BASE_IMAGE"
fi
LAUNCHER_GIT_COMMIT=${LAUNCHER_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}
export LAUNCHER_GIT_COMMIT
docker compose "${profile[@]}" build "$service"
