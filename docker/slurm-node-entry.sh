#!/bin/bash
# Entry of a test-cluster container (docker/slurm-node.Dockerfile, started by scripts/slurm-cluster.sh):
# munged with the cluster's key, then slurmctld (`ctld`) or one node's slurmd (`node NAME`) in the foreground.
#   SLURM_CONF          the cluster's slurm.conf (a folder mounted at the same path as on the host)
#   /etc/deltanet-slurm/munge.key  the key every member and the login node share (mounted read-only)
set -euo pipefail

install -o munge -g munge -m 400 /etc/deltanet-slurm/munge.key /etc/munge/munge.key
install -d -o munge -g munge /run/munge
runuser -u munge -- /usr/sbin/munged --force
for try in $(seq 1 40); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
    ((try < 40)) || {
        echo "slurm-node-entry: munged does not answer (munge -n | unmunge)" >&2
        exit 1
    }
    sleep 0.25
done

case ${1:-} in
    ctld) exec /usr/sbin/slurmctld -D -f "$SLURM_CONF" ;;
    node) exec /usr/sbin/slurmd -D -N "${2:?node name}" -f "$SLURM_CONF" ;;
    *)
        echo "usage: slurm-node-entry ctld | node NAME" >&2
        exit 2
        ;;
esac
