# A stand-in for the CANN base images (quay.io/ascend/cann:8.5.0-910b-ubuntu22.04-py3.11 and, with the build args
# of tests/containers/test_npu_standin.py, cann:9.0.0-910b-ubuntu22.04-py3.12), for building the npu and npu-cann9
# targets where no registry is reachable. It has only what those targets' build and entrypoint touch:
# - Python at /usr/local/python<version>/bin, first on PATH, where the CANN image has its own build (here a link
#   to the distribution's /usr/bin/python3.X of the local base image: Debian bookworm's 3.11, Ubuntu noble's 3.12);
# - stub set_env.sh files at the three CANN paths docker/entrypoint.sh sources; each appends its name
#   to CANN_STANDIN_SOURCED so a test can see that, and in which order, they were sourced.
# It has no CANN libraries: torch_npu cannot be imported in an image built on it.
ARG STANDIN_BASE=local/debian-python:bookworm
FROM ${STANDIN_BASE}
ARG PYTHON=python3.11
ARG PYTHON_HOME=/usr/local/python3.11.14
ARG CANN_VERSION=8.5.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=SC2016
RUN mkdir -p "${PYTHON_HOME}/bin" \
    && ln -s "/usr/bin/${PYTHON}" "${PYTHON_HOME}/bin/${PYTHON}" \
    && ln -s "${PYTHON}" "${PYTHON_HOME}/bin/python3" \
    && for f in /usr/local/Ascend/ascend-toolkit/set_env.sh \
                "/usr/local/Ascend/cann-${CANN_VERSION}/share/info/ascendnpu-ir/bin/set_env.sh" \
                /usr/local/Ascend/nnal/atb/set_env.sh; do \
           mkdir -p "$(dirname "$f")"; \
           printf 'export CANN_STANDIN_SOURCED="${CANN_STANDIN_SOURCED:+$CANN_STANDIN_SOURCED:}%s"\n' "$f" > "$f"; \
       done \
    && printf 'export ASCEND_HOME_PATH=/usr/local/Ascend/ascend-toolkit/latest\n' >> /usr/local/Ascend/ascend-toolkit/set_env.sh
ENV PATH=${PYTHON_HOME}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
