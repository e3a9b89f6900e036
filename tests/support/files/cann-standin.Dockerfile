# A stand-in for the CANN base image (quay.io/ascend/cann:8.5.0-910b-ubuntu22.04-py3.11), for building
# the npu target where no registry is reachable (tests/containers/test_npu_standin.py). It has only what the npu
# target's build and entrypoint touch:
# - Python 3.11 at /usr/local/python3.11.14/bin, first on PATH, where the CANN image has its own build
#   (here a link to Debian's /usr/bin/python3.11 from the local base image);
# - stub set_env.sh files at the three CANN paths docker/entrypoint.sh sources; each appends its name
#   to CANN_STANDIN_SOURCED so a test can see that, and in which order, they were sourced.
# It has no CANN libraries: torch_npu cannot be imported in an image built on it.
ARG STANDIN_BASE=local/debian-python:bookworm
FROM ${STANDIN_BASE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=SC2016
RUN mkdir -p /usr/local/python3.11.14/bin \
    && ln -s /usr/bin/python3.11 /usr/local/python3.11.14/bin/python3.11 \
    && ln -s python3.11 /usr/local/python3.11.14/bin/python3 \
    && for f in /usr/local/Ascend/ascend-toolkit/set_env.sh \
                /usr/local/Ascend/cann-8.5.0/share/info/ascendnpu-ir/bin/set_env.sh \
                /usr/local/Ascend/nnal/atb/set_env.sh; do \
           mkdir -p "$(dirname "$f")"; \
           printf 'export CANN_STANDIN_SOURCED="${CANN_STANDIN_SOURCED:+$CANN_STANDIN_SOURCED:}%s"\n' "$f" > "$f"; \
       done \
    && printf 'export ASCEND_HOME_PATH=/usr/local/Ascend/ascend-toolkit/latest\n' >> /usr/local/Ascend/ascend-toolkit/set_env.sh
ENV PATH=/usr/local/python3.11.14/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
