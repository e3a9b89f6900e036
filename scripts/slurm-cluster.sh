#!/usr/bin/env bash
# A Slurm cluster on one Debian machine, for tests and CI, run as root without systemd or cgroups:
# one slurmctld and two slurmd nodes (n1, n2: `slurmd -N`, both on 127.0.0.1, ports of their own), munge.
#
#   bash scripts/slurm-cluster.sh install        # slurmctld slurmd slurm-client munge (apt; Slurm 22.05 on Debian 12)
#   bash scripts/slurm-cluster.sh start [DIR]    # munged, slurmctld, slurmd n1 and n2; waits until both are idle
#   bash scripts/slurm-cluster.sh stop [DIR]     # stops what `start` started, by its pid files
#   bash scripts/slurm-cluster.sh status [DIR]   # exit 0 if both nodes answer
#   bash scripts/slurm-cluster.sh pid NODE [DIR] # the pid of node NODE's slurmd (a test kills it: NODE_LOST)
#
# DIR holds the config (slurm.conf), logs, spool and pid files (default: $SLURM_CLUSTER_DIR, else
# /var/run/deltanet-slurm). Commands find the cluster through SLURM_CONF=DIR/slurm.conf (`start` prints it).
# SlurmdTimeout is 10 s, so that a lost node is noticed fast; MinJobAge keeps ended jobs visible to
# `scontrol show job` for 10 minutes (there is no accounting storage: sacct does not answer).
set -euo pipefail

START_TIMEOUT_S=${SLURM_START_TIMEOUT_S:-60}
CTLD_PORT=${SLURM_CTLD_PORT:-16817}
NODE_PORTS=(16818 16819)
NODES=(n1 n2)

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
    cat >"$dir/slurm.conf" <<CONF
# written by scripts/slurm-cluster.sh: two nodes on one host, as root, no cgroups, no accounting
ClusterName=deltanet
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool/%n
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd-%n.pid
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
}

both_idle() {
    local dir=$1 states
    states=$(SLURM_CONF="$dir/slurm.conf" timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    for node in "${NODES[@]}"; do
        grep -Eq "^${node} (idle|allocated|mixed)" <<<"$states" || return 1
    done
}

cmd_install() {
    [[ $(id -u) -eq 0 ]] || die "install needs root (apt)"
    if [[ ! -x /usr/sbin/slurmctld || ! -x /usr/sbin/slurmd || ! -x /usr/bin/sbatch || ! -x /usr/sbin/munged ]]; then
        echo "slurm-cluster: installing slurmctld slurmd slurm-client munge (apt)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
    fi
    echo "slurm-cluster: $(sbatch --version)"
}

start_munge() {
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge
    chown munge:munge /run/munge
    runuser -u munge -- /usr/sbin/munged
    local deadline=$((SECONDS + 20))
    until munge -n 2>/dev/null | unmunge >/dev/null 2>&1; do
        ((SECONDS < deadline)) || die "munged does not answer (munge -n | unmunge)"
        sleep 0.5
    done
}

cmd_start() {
    local dir
    dir=$(cluster_dir "${1:-}")
    [[ -x /usr/sbin/slurmctld ]] || die "Slurm is not installed: run 'bash scripts/slurm-cluster.sh install' first"
    [[ $(id -u) -eq 0 ]] || die "start needs root (slurmd)"
    export SLURM_CONF=$dir/slurm.conf
    if both_idle "$dir"; then
        echo "slurm-cluster: already up; SLURM_CONF=$SLURM_CONF"
        return 0
    fi
    write_conf "$dir"
    start_munge
    alive "$dir/slurmctld.pid" || setsid /usr/sbin/slurmctld -c -f "$SLURM_CONF" </dev/null
    for node in "${NODES[@]}"; do
        mkdir -p "$dir/spool/$node"
        alive "$dir/slurmd-$node.pid" || setsid /usr/sbin/slurmd -N "$node" -f "$SLURM_CONF" </dev/null
    done
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until both_idle "$dir"; do
        if ((SECONDS >= deadline)); then
            tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd-*.log >&2 || true
            die "the nodes are not idle after ${START_TIMEOUT_S} s (logs in $dir)"
        fi
        # a node that was DOWN (e.g. its slurmd killed by a test) comes back through ReturnToService=2
        sleep 0.5
    done
    echo "slurm-cluster: up ($(sinfo -h -o '%D nodes %T' | paste -sd,)); SLURM_CONF=$SLURM_CONF"
}

alive() {
    local pid
    [[ -s $1 ]] || return 1
    pid=$(cat "$1")
    kill -0 "$pid" 2>/dev/null
}

stop_pidfile() {
    local file=$1 pid
    alive "$file" || return 0
    pid=$(cat "$file")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.25
    done
    kill -9 "$pid" 2>/dev/null || true
}

cmd_stop() {
    local dir
    dir=$(cluster_dir "${1:-}")
    for node in "${NODES[@]}"; do
        stop_pidfile "$dir/slurmd-$node.pid"
    done
    stop_pidfile "$dir/slurmctld.pid"
    echo "slurm-cluster: stopped (munged keeps running: other users of munge may need it)"
}

cmd_status() {
    local dir
    dir=$(cluster_dir "${1:-}")
    both_idle "$dir"
}

cmd_pid() {
    local node=${1:?node name} dir
    dir=$(cluster_dir "${2:-}")
    cat "$dir/slurmd-$node.pid"
}

case ${1:-} in
    install) cmd_install ;;
    start) cmd_start "${2:-}" ;;
    stop) cmd_stop "${2:-}" ;;
    status) cmd_status "${2:-}" ;;
    pid) cmd_pid "${2:-}" "${3:-}" ;;
    *) die "usage: $0 install|start [DIR]|stop [DIR]|status [DIR]|pid NODE [DIR]" ;;
esac
