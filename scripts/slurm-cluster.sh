#!/usr/bin/env bash
# A real Slurm cluster of containers on one Debian machine, for tests and CI (root, a running Docker engine):
# one controller and two nodes, each a container of docker/slurm-node.Dockerfile (the cpu image with Debian
# 12's Slurm 22.05 and munge), sharing one munge key, on the host's network; this machine is the login node.
#
#   bash scripts/slurm-cluster.sh install        # the login node's slurm-client and munge (apt)
#   bash scripts/slurm-cluster.sh start [DIR]    # the node image, munged here, the three containers; waits
#                                                # until both nodes are idle. A stopped or killed member is
#                                                # started again, a changed setup recreates all three
#   bash scripts/slurm-cluster.sh stop [DIR]     # removes the three containers (and the munged `start` started)
#   bash scripts/slurm-cluster.sh status [DIR]   # exit 0 if both nodes answer
#
# Containers: deltanet-slurm-ctl (slurmctld), deltanet-slurm-n1 and deltanet-slurm-n2 (slurmd -N n1 / n2);
# `docker kill deltanet-slurm-n2` loses a node with every process on it, `start` brings it back.
# DIR holds slurm.conf, the logs, the controller's state and the spool (default: $SLURM_CLUSTER_DIR, else
# /var/run/deltanet-slurm); it and SLURM_SHARED_DIR (the shared storage: run folders, models, data) are
# mounted at the same paths in every container. The login node's commands find the cluster through
# SLURM_CONF=DIR/slurm.conf (`start` prints it); `docker exec deltanet-slurm-ctl launcher submit ...` submits
# with the image's own launcher. SLURM_CLUSTER_IMAGE: the image the nodes are built on
# (default: the cpu image this checkout's compose builds, deltanet-launcher:<project>-cpu: `bash scripts/build-image.sh
# cpu`; `docker compose --profile cpu config --images train-cpu` names it). SlurmdTimeout is 10 s, so that a lost
# node is noticed fast; AuthInfo=cred_expire=60 (Slurm's default 120 s) is also how long 22.05 holds a requeued job
# before it may start again (src/slurmctld/job_mgr.c: begin_time = now + the credential lifetime + 1), so a requeue
# waits 61 s, past the old step's KillWait of 30 s; MinJobAge keeps ended jobs visible to `scontrol show job` for
# 10 minutes (there is no accounting storage: sacct does not answer).
set -euo pipefail

START_TIMEOUT_S=${SLURM_START_TIMEOUT_S:-90}
CTLD_PORT=${SLURM_CTLD_PORT:-16817}
NODE_PORTS=(16818 16819)
NODES=(n1 n2)
PREFIX=deltanet-slurm
NODE_IMAGE=deltanet-slurm-node
KEY=/etc/munge/munge.key
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [[ -x /usr/bin/docker ]]; then DOCKER=/usr/bin/docker; else DOCKER=$(command -v docker || echo docker); fi
BASE_IMAGE=${SLURM_CLUSTER_IMAGE:-$(cd "$HERE" && "$DOCKER" compose --profile cpu config --images train-cpu 2>/dev/null || true)}

die() {
    echo "slurm-cluster: $*" >&2
    exit 1
}

cluster_dir() {
    local dir=${1:-${SLURM_CLUSTER_DIR:-/var/run/deltanet-slurm}}
    mkdir -p "$dir"
    (cd "$dir" && pwd)
}

write_conf() {
    local dir=$1 cpus
    cpus=$(nproc)
    mkdir -p "$dir/state" "$dir/spool"
    cat >"$dir/slurm.conf.new" <<CONF
# written by scripts/slurm-cluster.sh: a controller and two nodes, containers on one host's network, as root,
# no cgroups, no accounting
ClusterName=deltanet
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
AuthType=auth/munge
AuthInfo=cred_expire=60
SlurmUser=root
SlurmdUser=root
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=${dir}/slurmctld.log
SlurmdLogFile=${dir}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MinJobAge=600
KillWait=30
NodeName=${NODES[0]} NodeAddr=127.0.0.1 NodeHostname=$(hostname) Port=${NODE_PORTS[0]} CPUs=${cpus} State=UNKNOWN
NodeName=${NODES[1]} NodeAddr=127.0.0.1 NodeHostname=$(hostname) Port=${NODE_PORTS[1]} CPUs=${cpus} State=UNKNOWN
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP
CONF
    if cmp -s "$dir/slurm.conf.new" "$dir/slurm.conf"; then
        rm -f "$dir/slurm.conf.new"
    else
        mv "$dir/slurm.conf.new" "$dir/slurm.conf"
    fi
}

both_idle() {
    local dir=$1 states
    states=$(SLURM_CONF="$dir/slurm.conf" timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    for node in "${NODES[@]}"; do
        # `idle*`, `mixed*`: Slurm's mark of a node that does not answer
        grep -Eq "^${node} (idle|allocated|mixed)$" <<<"$states" || return 1
    done
}

cmd_install() {
    [[ $(id -u) -eq 0 ]] || die "install needs root (apt)"
    if [[ ! -x /usr/bin/sbatch || ! -x /usr/bin/scontrol || ! -x /usr/sbin/munged ]]; then
        echo "slurm-cluster: installing slurm-client munge for the login node (apt)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends slurm-client munge >/dev/null
    fi
    echo "slurm-cluster: $(dpkg-query -W -f '${Package} ${Version}' slurm-client)"
}

start_munge() {
    if [[ ! -s $KEY ]]; then
        dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
    fi
    chown munge:munge "$KEY"
    chmod 400 "$KEY"
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    install -d -o munge -g munge /run/munge
    runuser -u munge -- /usr/sbin/munged --force
    touch "$1/munged.started" # `stop` stops the munged that `start` started, no other
    local deadline=$((SECONDS + 20))
    until munge -n 2>/dev/null | unmunge >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "munged does not answer (munge -n | unmunge)"
        sleep 0.5
    done
}

node_image() {
    local base
    [[ -n $BASE_IMAGE ]] || die "no cpu image named: docker compose does not answer here; set SLURM_CLUSTER_IMAGE"
    base=$("$DOCKER" image inspect -f '{{.Id}}' "$BASE_IMAGE" 2>/dev/null) ||
        die "no image $BASE_IMAGE to build the nodes on: bash scripts/build-image.sh cpu (or set SLURM_CLUSTER_IMAGE)"
    if [[ $("$DOCKER" image inspect -f '{{index .Config.Labels "deltanet.slurm.base"}}' "$NODE_IMAGE" 2>/dev/null) != "$base" ]]; then
        echo "slurm-cluster: building $NODE_IMAGE on $BASE_IMAGE (apt: slurmctld slurmd slurm-client munge)" >&2
        timeout 900 "$DOCKER" build --quiet -f "$HERE/docker/slurm-node.Dockerfile" --build-arg "BASE=$BASE_IMAGE" \
            --label "deltanet.slurm.base=$base" -t "$NODE_IMAGE" "$HERE/docker" >/dev/null
    fi
    "$DOCKER" image inspect -f '{{.Id}}' "$NODE_IMAGE"
}

# member NAME SETUP ROLE...: the container NAME running, for this setup (a label); started again if it was
# stopped or killed, made anew if it was made for another setup
member() {
    local name=$1 setup=$2 have
    shift 2
    have=$("$DOCKER" inspect -f '{{index .Config.Labels "deltanet.slurm.setup"}} {{.State.Running}}' "$name" 2>/dev/null || true)
    case $have in
        "$setup true") return 0 ;;
        "$setup false")
            "$DOCKER" start "$name" >/dev/null
            return 0
            ;;
    esac
    "$DOCKER" rm -f "$name" >/dev/null 2>&1 || true
    local mounts=(-v "$dir:$dir" -v "$KEY:/etc/deltanet-slurm/munge.key:ro")
    if [[ -n $shared ]]; then
        [[ $dir == "$shared" || $dir == "$shared"/* ]] && mounts=(-v "$KEY:/etc/deltanet-slurm/munge.key:ro")
        mounts+=(-v "$shared:$shared")
    fi
    "$DOCKER" run -d --name "$name" --label "deltanet.slurm.setup=$setup" --network host --ipc host --init \
        --tmpfs /run "${mounts[@]}" -e "SLURM_CONF=$dir/slurm.conf" "$NODE_IMAGE" "$@" >/dev/null
}

cmd_start() {
    dir=$(cluster_dir "${1:-}")
    shared=${SLURM_SHARED_DIR:-}
    [[ -z $shared ]] || shared=$(cd "$shared" && pwd) || die "SLURM_SHARED_DIR=$SLURM_SHARED_DIR is not a folder"
    [[ $(id -u) -eq 0 ]] || die "start needs root (munged, the Docker engine)"
    [[ -x /usr/bin/scontrol ]] || die "Slurm's client is not installed: run 'bash scripts/slurm-cluster.sh install' first"
    timeout 10 "$DOCKER" info >/dev/null 2>&1 || die "no Docker engine answers: bash scripts/docker-engine.sh start"
    local image setup
    image=$(node_image)
    write_conf "$dir"
    start_munge "$dir"
    setup="image=$image dir=$dir shared=$shared conf=$(md5sum <"$dir/slurm.conf" | cut -c1-12) key=$(md5sum <"$KEY" | cut -c1-12)"
    if [[ $("$DOCKER" inspect -f '{{index .Config.Labels "deltanet.slurm.setup"}}' "$PREFIX-ctl" 2>/dev/null) != "$setup" ]]; then
        rm -rf "${dir:?}/state" "${dir:?}/spool" # a new setup: no jobs or node state of an earlier one
        mkdir -p "$dir/state" "$dir/spool"
    fi
    member "$PREFIX-ctl" "$setup" ctld
    for node in "${NODES[@]}"; do
        member "$PREFIX-$node" "$setup" node "$node"
    done
    export SLURM_CONF=$dir/slurm.conf
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until both_idle "$dir"; do
        if ((SECONDS >= deadline)); then
            tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd-*.log >&2 || true
            die "the nodes are not idle after ${START_TIMEOUT_S} s (logs in $dir)"
        fi
        # a node that was DOWN (its container killed by a test) comes back through ReturnToService=2
        sleep 0.5
    done
    echo "slurm-cluster: up ($(sinfo -h -o '%D nodes %T' | paste -sd,)); SLURM_CONF=$SLURM_CONF"
}

cmd_stop() {
    local dir
    dir=$(cluster_dir "${1:-}")
    timeout 120 "$DOCKER" rm -f "$PREFIX-ctl" "${NODES[@]/#/$PREFIX-}" >/dev/null 2>&1 || true
    if [[ -e $dir/munged.started && -s /run/munge/munged.pid ]]; then
        kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true
        rm -f "$dir/munged.started"
        echo "slurm-cluster: stopped (and the munged that start started)"
    else
        echo "slurm-cluster: stopped"
    fi
}

cmd_status() {
    both_idle "$(cluster_dir "${1:-}")"
}

case ${1:-} in
    install) cmd_install ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    status) cmd_status "${2:-}" ;;
    *) die "usage: $0 install | start [DIR] | stop [DIR] | status [DIR]" ;;
esac
