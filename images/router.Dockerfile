# kvship router: the OpenAI-compatible gateway. Slim Python, no torch.
#   docker build -f images/router.Dockerfile -t REGISTRY/kvship/router:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

# What `kvship router` imports at run time (kvship itself goes in without its torch-bearing deps).
ARG ROUTER_DEPS="aiohttp fastapi starlette uvicorn[standard] httpx pydantic prometheus-client kubernetes pyyaml"

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml setup.py README* ./
COPY engine ./engine
COPY prefill ./prefill
COPY decode ./decode
COPY router ./router
COPY operator ./operator
COPY common ./common
COPY app ./app

RUN pip install --no-deps . \
 && pip install $ROUTER_DEPS \
 && rm -rf /src \
 && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvship

USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp
EXPOSE 8000
ENTRYPOINT ["kvship"]
CMD ["router", "--help"]
