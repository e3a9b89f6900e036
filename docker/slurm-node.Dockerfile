# A node of the test Slurm cluster (scripts/slurm-cluster.sh): the project's cpu image with Debian 12's
# Slurm 22.05 (slurmctld, slurmd, client) and munge, installed from the base's own apt sources.
# One image serves the controller (`ctld`) and the nodes (`node NAME`); docker/slurm-node-entry.sh starts them.
ARG BASE=deltanet-launcher:cpu
FROM ${BASE}
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge >/dev/null \
    && rm -rf /var/lib/apt/lists/*
# not a compose service: the compose labels the base image was built with, emptied (compose finds its
# containers by them)
LABEL com.docker.compose.project="" com.docker.compose.service="" com.docker.compose.version=""
COPY slurm-node-entry.sh /usr/local/bin/slurm-node-entry
ENTRYPOINT ["/usr/local/bin/slurm-node-entry"]
