# kvship operator: kopf + the InferenceService controller. Slim Python, no torch.
#   docker build -f images/operator.Dockerfile -t REGISTRY/kvship/operator:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Dependencies first, from the pinned list generated from pyproject's [operator] extra
# (python images/lock.py): a source edit reuses this layer.
COPY images/requirements-operator.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt \
 && useradd --uid 1000 --user-group --no-create-home --home-dir /tmp kvship

# Then kvship itself, without its torch-bearing dependencies.
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
 && rm -rf /src

USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["kvship"]
CMD ["operator"]
