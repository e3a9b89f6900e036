# Training images for LoRA fine-tuning of Qwen3.5 (hybrid Gated DeltaNet) with LLaMA-Factory 0.9.5.
#
#   npu  (default target): Ascend 910B. CANN 8.5.0, Python 3.11, torch 2.7.1 (CPU build) + torch-npu
#        2.7.1.post2, triton-ascend 3.2.0 (no community triton), fla-core 0.6.0; Python from requirements.lock.
#        Everything from PyPI.
#   npu-cann9: Ascend 910B on the pairing fla-core 0.6.0 declares for NPU: CANN 9.0.0, Python 3.12, torch
#        2.10.0 (CPU build) + torch-npu 2.10.0.post7, triton-ascend 3.6.0, fla-core 0.6.0; Python from
#        requirements-npu-cann9.lock, plus the triton-ascend 3.6.0 wheel the user brings (not on PyPI):
#          TRITON_ASCEND_SHA256=<its sha256> WHEELHOUSE=<folder> docker compose --profile cann9 build train-cann9
#        The build refuses the wheel unless its sha256 equals TRITON_ASCEND_SHA256 (docs/environment.md).
#   cuda: NVIDIA GPUs (x86_64). torch 2.7.1 (CUDA 12.6 wheels) + triton 3.3.1, fla-core 0.6.0; Python from
#        requirements-cuda.lock.
#   cpu:  the CPU demo and the container tests (x86_64). The development environment's torch 2.14.1 stack
#        and the same training stack; Python from requirements-cpu.lock.
#
#   docker compose build train                      # npu (what `docker compose up train` runs)
#   docker compose --profile cann9 build train-cann9  # npu-cann9 (offline only, see above)
#   docker compose --profile cuda build train-cuda  # cuda
#   docker compose --profile cpu build train-cpu    # cpu
#   docker build --target cuda -t deltanet-launcher:cuda .   # then LAUNCHER_CUDA_IMAGE=deltanet-launcher:cuda for compose
#
# Compose tags each checkout's images deltanet-launcher:<project>-<target> (docs/containers.md, "Two checkouts on
# one engine"); `docker compose config --images` names them.
#
# Offline (air-gapped server): make a wheelhouse for the lock and the server's platform on a connected
# machine, copy it into this folder's wheelhouse/<name>/, and build with WHEELHOUSE=<name>:
#   python3 docker/wheelhouse.py download requirements.lock wheelhouse/npu-aarch64 --platform aarch64
#   WHEELHOUSE=npu-aarch64 docker compose build train
# The wheelhouse is bind-mounted into the install step only (no wheel lands in a layer); a wheelhouse
# that lacks a locked wheel stops the build with one message naming the packages. Without WHEELHOUSE
# the build installs from PyPI. No `# syntax=` line: the builder's own Dockerfile frontend is used, so
# nothing is pulled from a registry for it (RUN --mount needs BuildKit: Docker 23+, or DOCKER_BUILDKIT=1).
#
# Why these versions (docs/environment.md has the table and the commands that checked them):
# - Verified here with pip/uv against PyPI: triton-ascend 3.2.0 is the newest triton-ascend on PyPI;
#   torch-npu 2.7.1.post2's wheels require torch==2.7.1 (aarch64) / torch==2.7.1+cpu (x86_64);
#   PyPI's aarch64 torch 2.7.1 has no CUDA or triton dependencies (a CPU build), its x86_64 wheel is a
#   CUDA build that pulls triton 3.3.1; fla-core 0.6.0 is pure Python (needs einops only).
# - Taken from upstream documentation (not verifiable without an NPU):
#   * triton-ascend installation guide (Ascend/triton-ascend, docs/en/installation_guide.md): 3.2.0 goes
#     with CANN 8.5.0 and torch_npu 2.7.1; community triton and triton-ascend cannot coexist.
#   * Ascend/pytorch README, "Ascend Extension for PyTorch Version Matching Table": torch_npu 2.7.1.post2
#     (branch v2.7.1-7.3.0) goes with PyTorch 2.7.1 and CANN 8.5.0.
#   * CANN 8.5.0 release notes, "CANN Version Mapping": host driver (Ascend HDK) 25.0.X, 25.2.X, 25.3.X
#     or 25.5.X; `launcher preflight` compares the mounted driver against that list.
#   * fla-core 0.6.0 declares torch_npu 2.10.0.post7 + triton-ascend 3.6.0 for NPU in its own metadata;
#     triton-ascend 3.6.0 is not on PyPI, so fla-core 0.6.0 on triton-ascend 3.2.0 is an undeclared pair
#     and `launcher preflight` runs the DeltaNet kernel on the device before every run.
#   * FLA refuses Hopper GPUs with 3.4.0 <= triton < 3.7.1 (fla-org/flash-linear-attention#640); the CUDA
#     target's triton 3.3.1 is below that range.
#
# User and permissions: the images have no user of their own and run as root unless compose's
# UID/GID say otherwise. The Ascend device nodes (/dev/davinci*, davinci_manager, devmm_svm, hisi_hdc)
# belong to the host's HwHiAiUser group with mode 0660 and that group's id differs from host to host, so
# a fixed non-root user cannot open them; compose.yaml runs as "${UID}:${GID}" with DEVICE_GID added
# instead (docs/containers.md). The container is not privileged either way: compose.yaml passes only
# the listed devices, mounts the driver read-only and sets no-new-privileges. Everything the image
# writes at run time goes to the mounted outputs and logs.
#
# Layers are ordered for cache reuse: base image, then the locked install (changes only with the lock),
# then the project's own files (change often). No secrets are used or stored: everything comes from PyPI.

# Base images. Record the digest (`docker buildx imagetools inspect <tag>`) at first pull and pin it by
# appending @sha256:... to the tag; it is not recorded yet because no registry is reachable from where
# this file was written. Tag scheme: <cann-version>-<chip>-<os><os-version>-<py-version>
# (Ascend/cann-container-image, cann/8.5.0-910b-ubuntu22.04-py3.11/Dockerfile).
#
# REGISTRY_MIRROR (e.g. mirror.example.com or mirror.example.com/proxy): a registry mirror that serves each
# public registry under its host name (mirror.example.com/docker.io/library/python, .../quay.io/ascend/cann);
# the base images are then pulled from it. A mirror with another layout: set CANN_IMAGE, CUDA_BASE_IMAGE or
# CPU_BASE_IMAGE to the mirrored names instead. Without any registry: the cpu target builds on a local base
# image (scripts/build-image.sh cpu does it all).
ARG REGISTRY_MIRROR=""
ARG CANN_IMAGE=${REGISTRY_MIRROR:+${REGISTRY_MIRROR}/}quay.io/ascend/cann:8.5.0-910b-ubuntu22.04-py3.11
# Python 3.12.13 at /usr/local/python3.12.13 (Ascend/cann-container-image, cann/9.0.0-910b-ubuntu22.04-py3.12).
ARG CANN9_IMAGE=${REGISTRY_MIRROR:+${REGISTRY_MIRROR}/}quay.io/ascend/cann:9.0.0-910b-ubuntu22.04-py3.12
# Full Debian image, not -slim: Triton compiles a small C launcher with gcc and Python.h at run time.
ARG CUDA_BASE_IMAGE=${REGISTRY_MIRROR:+${REGISTRY_MIRROR}/}docker.io/library/python:3.11.14-bookworm
# Any Debian/Ubuntu image with Python 3.11 as `python3.11` on PATH and its venv module (the official
# image has it at /usr/local/bin, Debian's python3.11 at /usr/bin). The tests use a local debootstrap
# image (scripts/docker-base-image.sh) because no registry is reachable there.
ARG CPU_BASE_IMAGE=${REGISTRY_MIRROR:+${REGISTRY_MIRROR}/}docker.io/library/python:3.11.14-bookworm

# ---------------------------------------------------------------------------------------------------
FROM ${CUDA_BASE_IMAGE} AS cuda

ARG TORCH_VERSION=2.7.1
ARG TRITON_VERSION=3.3.1
ARG FLA_VERSION=0.6.0
ARG LLAMAFACTORY_VERSION=0.9.5

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

WORKDIR /opt/launcher
RUN python3.11 -m venv /opt/venv

# --no-deps: the lock is the complete, resolved set; pip only verifies hashes and installs it
# (docker/wheelhouse.py install runs pip with --no-cache-dir --no-deps --require-hashes --only-binary=:all:,
# plus --no-index --find-links /wheelhouse/$WHEELHOUSE when WHEELHOUSE is set).
COPY requirements-cuda.lock ./
COPY docker/wheelhouse.py docker/
ARG WHEELHOUSE=""
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python docker/wheelhouse.py install requirements-cuda.lock

COPY docker/verify_image.py docker/
RUN python docker/verify_image.py "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}" \
        "fla-core==${FLA_VERSION}" "llamafactory==${LLAMAFACTORY_VERSION}" --absent triton-ascend

COPY pyproject.toml README.md ./
COPY patches/ patches/
COPY launcher/ launcher/
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --editable .
COPY configs/ configs/
COPY requirements.in requirements.lock requirements-cuda.in requirements-cpu.in requirements-cpu.lock ./
COPY docker/entrypoint.sh /usr/local/bin/launcher-entrypoint

# The commit of the project, recorded in every run's manifest (compose passes it as a build arg).
ARG LAUNCHER_GIT_COMMIT=""
# A global ARG (before the first FROM) is empty inside a stage unless declared again here.
ARG CUDA_BASE_IMAGE
ENV LAUNCHER_GIT_COMMIT=${LAUNCHER_GIT_COMMIT} \
    LAUNCHER_BASE_IMAGE=${CUDA_BASE_IMAGE}

ENTRYPOINT ["/usr/local/bin/launcher-entrypoint"]
CMD ["launcher", "--help"]

# ---------------------------------------------------------------------------------------------------
FROM ${CPU_BASE_IMAGE} AS cpu

ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG TORCHAUDIO_VERSION=2.11.1
ARG LLAMAFACTORY_VERSION=0.9.5

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

WORKDIR /opt/launcher
RUN python3.11 -m venv /opt/venv

COPY requirements-cpu.lock ./
COPY docker/wheelhouse.py docker/
ARG WHEELHOUSE=""
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python docker/wheelhouse.py install requirements-cpu.lock

COPY docker/verify_image.py docker/
RUN python docker/verify_image.py "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
        "torchaudio==${TORCHAUDIO_VERSION}" "llamafactory==${LLAMAFACTORY_VERSION}" \
        --absent torch-npu --absent triton-ascend

COPY pyproject.toml README.md ./
COPY patches/ patches/
COPY launcher/ launcher/
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --editable .
# The CPU demo's tiny model and data (built locally, deterministic, ~2 MB), at the paths
# configs/demo_cpu.yaml names relative to /opt/launcher; its outputs/ is the outputs volume, so
# `docker compose --profile cpu up train-cpu` writes OUTPUTS_DIR/runs/<run_id>/ on the host.
# (launcher demo-assets writes its files owner-only; a+rX lets a non-root UID read them.)
RUN launcher demo-assets --out demo && chmod -R a+rX demo && ln -s /outputs outputs
COPY configs/ configs/
COPY requirements.in requirements.lock requirements-cuda.in requirements-cpu.in requirements-cpu.lock ./
COPY docker/entrypoint.sh /usr/local/bin/launcher-entrypoint

ARG LAUNCHER_GIT_COMMIT=""
# A global ARG (before the first FROM) is empty inside a stage unless declared again here.
ARG CPU_BASE_IMAGE
ENV LAUNCHER_GIT_COMMIT=${LAUNCHER_GIT_COMMIT} \
    LAUNCHER_BASE_IMAGE=${CPU_BASE_IMAGE}

ENTRYPOINT ["/usr/local/bin/launcher-entrypoint"]
CMD ["launcher", "--help"]

# ---------------------------------------------------------------------------------------------------
# The pairing fla-core 0.6.0 declares for NPU (its `npu` extra: torch 2.10.0, torch_npu 2.10.0.post7, torchvision
# 0.25.0, triton-ascend 3.6.0), on CANN 9.x with Python 3.12. Built like `npu` (hash lock, offline from a
# wheelhouse, pins verified), plus one wheel no public index carries: triton-ascend 3.6.0, which the user puts
# into the wheelhouse and pins by its sha256 (TRITON_ASCEND_SHA256); the build refuses any other file. The image
# records the pinned hash (LAUNCHER_TRITON_ASCEND_SHA256), and every run's manifest.json copies it.
FROM ${CANN9_IMAGE} AS npu-cann9

ARG CANN_VERSION=9.0.0
ARG TORCH_VERSION=2.10.0
ARG TORCH_NPU_VERSION=2.10.0.post7
ARG TRITON_ASCEND_VERSION=3.6.0
ARG FLA_VERSION=0.6.0
ARG LLAMAFACTORY_VERSION=0.9.5

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    LAUNCHER_CANN_VERSION=${CANN_VERSION} \
    LAUNCHER_LOCK=requirements-npu-cann9.lock

WORKDIR /opt/launcher
RUN python3.12 -m venv /opt/venv

COPY requirements-npu-cann9.lock ./
COPY docker/wheelhouse.py docker/
ARG WHEELHOUSE=""
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python docker/wheelhouse.py install requirements-npu-cann9.lock
# The user's triton-ascend wheel: installed only when its sha256 equals the pinned value (an empty pin refuses).
ARG TRITON_ASCEND_SHA256=""
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python docker/wheelhouse.py install-pinned "triton-ascend==${TRITON_ASCEND_VERSION}" \
        --sha256 "${TRITON_ASCEND_SHA256}"

COPY docker/verify_image.py docker/
RUN python docker/verify_image.py "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}" \
        "triton-ascend==${TRITON_ASCEND_VERSION}" "fla-core==${FLA_VERSION}" \
        "llamafactory==${LLAMAFACTORY_VERSION}" --absent triton

COPY pyproject.toml README.md ./
COPY patches/ patches/
COPY launcher/ launcher/
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --editable .
COPY configs/ configs/
COPY requirements.in requirements.lock requirements-cuda.in requirements-cpu.in requirements-cpu.lock \
     requirements-npu-cann9.in requirements-npu-cann9.lock ./
COPY docker/entrypoint.sh /usr/local/bin/launcher-entrypoint

ARG LAUNCHER_GIT_COMMIT=""
ARG CANN9_IMAGE
ENV LAUNCHER_GIT_COMMIT=${LAUNCHER_GIT_COMMIT} \
    LAUNCHER_BASE_IMAGE=${CANN9_IMAGE} \
    LAUNCHER_TRITON_ASCEND_SHA256=${TRITON_ASCEND_SHA256}

ENTRYPOINT ["/usr/local/bin/launcher-entrypoint"]
CMD ["launcher", "--help"]

# ---------------------------------------------------------------------------------------------------
FROM ${CANN_IMAGE} AS npu

ARG CANN_VERSION=8.5.0
ARG TORCH_VERSION=2.7.1
ARG TORCH_NPU_VERSION=2.7.1.post2
ARG TRITON_ASCEND_VERSION=3.2.0
ARG FLA_VERSION=0.6.0
ARG LLAMAFACTORY_VERSION=0.9.5

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# LAUNCHER_CANN_VERSION: read by docker/entrypoint.sh (which set_env.sh files to source) and by
# `launcher preflight` (driver compatibility). Ascend's recommended host-dispatch settings
# (TASK_QUEUE_ENABLE, CPU_AFFINITY_CONF) are set in compose.yaml so they can be changed per run.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    LAUNCHER_CANN_VERSION=${CANN_VERSION}

WORKDIR /opt/launcher
# The base image's Python 3.11 (its own build, on PATH); CANN's Python modules reach the venv through
# the PYTHONPATH that set_env.sh sets.
RUN python3.11 -m venv /opt/venv

# --no-deps: the lock is the complete, resolved set. Without it pip would try to satisfy torch-npu's
# x86_64 requirement torch==2.7.1+cpu (not on PyPI) and torch's own `triton` requirement on x86_64,
# which must not be installed next to triton-ascend.
COPY requirements.lock ./
COPY docker/wheelhouse.py docker/
ARG WHEELHOUSE=""
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \
    python docker/wheelhouse.py install requirements.lock

COPY docker/verify_image.py docker/
RUN python docker/verify_image.py "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}" \
        "triton-ascend==${TRITON_ASCEND_VERSION}" "fla-core==${FLA_VERSION}" \
        "llamafactory==${LLAMAFACTORY_VERSION}" --absent triton

COPY pyproject.toml README.md ./
COPY patches/ patches/
COPY launcher/ launcher/
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index --editable .
COPY configs/ configs/
COPY requirements.in requirements.lock requirements-cuda.in requirements-cpu.in requirements-cpu.lock ./
COPY docker/entrypoint.sh /usr/local/bin/launcher-entrypoint

ARG LAUNCHER_GIT_COMMIT=""
# A global ARG (before the first FROM) is empty inside a stage unless declared again here.
ARG CANN_IMAGE
ENV LAUNCHER_GIT_COMMIT=${LAUNCHER_GIT_COMMIT} \
    LAUNCHER_BASE_IMAGE=${CANN_IMAGE}

# The CANN environment is sourced by the entrypoint, so it is in effect for the main process (the
# base image's own ENTRYPOINT, which did the same, is replaced by this one).
ENTRYPOINT ["/usr/local/bin/launcher-entrypoint"]
CMD ["launcher", "--help"]
