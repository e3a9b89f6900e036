#!/usr/bin/env bash
# Build the local Debian base image for the cpu target when no registry is reachable:
#
#   bash scripts/docker-base-image.sh [TAG]        # default TAG: local/debian-python:bookworm
#   FORCE=1 bash scripts/docker-base-image.sh       # rebuild even if the image exists
#
# debootstrap --variant=minbase bookworm with python3 (3.11, at /usr/bin/python3.11), python3-venv and
# ca-certificates (Debian's own bundle), then `docker import`. Nothing else: the cpu image needs no
# compiler (CPU torch has no Triton). The image is rebuilt whenever `docker image inspect` says it is
# missing. The Debian mirror is read from the machine's apt sources at run time (DEBIAN_MIRROR
# overrides it). Needs root, debootstrap and a running engine (scripts/docker-engine.sh).
#
# Another suite, e.g. Ubuntu 24.04 with Python 3.12 (the base of the npu-cann9 stand-in,
# tests/containers/test_npu_standin.py):
#   DEBIAN_SUITE=noble DEBIAN_MIRROR=<an Ubuntu archive mirror> BASE_PYTHON=python3.12 \
#   DEBOOTSTRAP_COMPONENTS=main,universe DEBOOTSTRAP_KEYRING=<ubuntu-archive-keyring.gpg> \
#   bash scripts/docker-base-image.sh local/ubuntu-python:noble
# A suite debootstrap has no script for takes Ubuntu's common one (gutsy), which serves every release since.
set -euo pipefail

TAG=${1:-${BASE_IMAGE_TAG:-local/debian-python:bookworm}}
SUITE=${DEBIAN_SUITE:-bookworm}
PACKAGES=python3,python3-venv,ca-certificates
PYTHON=${BASE_PYTHON:-python3.11}
DOCKER=/usr/bin/docker

die() {
    echo "docker-base-image: $*" >&2
    exit 1
}

[[ -x $DOCKER ]] || die "no Docker client at $DOCKER: run 'bash scripts/docker-engine.sh install' first"
timeout 10 "$DOCKER" info >/dev/null 2>&1 ||
    die "no Docker engine answers: run 'bash scripts/docker-engine.sh start' first"
if [[ -z ${FORCE:-} ]] && "$DOCKER" image inspect "$TAG" >/dev/null 2>&1; then
    echo "docker-base-image: $TAG exists ($("$DOCKER" image inspect --format '{{.Id}}' "$TAG"))"
    exit 0
fi
command -v debootstrap >/dev/null || die "debootstrap is not installed: run 'bash scripts/docker-engine.sh install' first"

mirror=${DEBIAN_MIRROR:-}
if [[ -z $mirror ]]; then
    for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        mirror=$(awk '/^URIs:/{print $2; exit}' "$f")
        [[ -n $mirror ]] && break
    done
fi
if [[ -z $mirror && -f /etc/apt/sources.list ]]; then
    mirror=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list)
fi
[[ -n $mirror ]] || die "no Debian mirror found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list; set DEBIAN_MIRROR"

script=/usr/share/debootstrap/scripts/$SUITE
[[ -e $script ]] || script=/usr/share/debootstrap/scripts/gutsy
options=(--components="${DEBOOTSTRAP_COMPONENTS:-main}")
if [[ -n ${DEBOOTSTRAP_KEYRING:-} ]]; then
    [[ -f $DEBOOTSTRAP_KEYRING ]] || die "DEBOOTSTRAP_KEYRING=$DEBOOTSTRAP_KEYRING is not a file"
    options+=(--keyring="$DEBOOTSTRAP_KEYRING")
fi

rootfs=$(mktemp -d /tmp/debian-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "docker-base-image: debootstrap $SUITE ($PACKAGES) -> $TAG"
debootstrap --variant=minbase "${options[@]}" --include="$PACKAGES" "$SUITE" "$rootfs" "$mirror" "$script" \
    >"$rootfs.log" 2>&1 || {
    tail -n 20 "$rootfs.log" >&2
    die "debootstrap failed (log: $rootfs.log)"
}
rm -f "$rootfs.log"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/tmp/*
tar -C "$rootfs" --numeric-owner -c . |
    "$DOCKER" import --change 'CMD ["/bin/bash"]' \
        --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --message "debootstrap --variant=minbase --include=$PACKAGES $SUITE" - "$TAG" >/dev/null
"$DOCKER" run --rm "$TAG" "$PYTHON" -c 'import ensurepip, ssl, venv' ||
    die "the new image $TAG cannot import ensurepip/ssl/venv"
echo "docker-base-image: built $TAG ($("$DOCKER" image inspect --format '{{.Size}}' "$TAG") bytes)"
