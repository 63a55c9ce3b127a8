# kvship operator: kopf + the InferenceService controller. Slim Python, no torch.
#   docker build -f images/operator.Dockerfile -t REGISTRY/kvship/operator:0.1.0 .
# BASE: any Debian/Ubuntu image whose `python3 -m venv` works (python:3.11-slim-bookworm by default; images/build.sh
# passes a local Debian root filesystem where no registry can be reached). Build and run: docs/operator.md, "Images".
ARG BASE=python:3.11-slim-bookworm

# ---- build stage: a venv with the pinned dependencies and kvship; only /opt/kvship leaves it
FROM ${BASE} AS build
# pip settings of the build machine (index mirrors, local wheels, a CA bundle): build arguments, so they never
# reach the final image's environment.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kvship/bin:$PATH
RUN python3 -m venv /opt/kvship

# Dependencies first, from the pinned list generated from pyproject's [operator] extra
# (python images/lock.py): a source edit reuses this layer.
COPY images/requirements-operator.txt /tmp/requirements.txt
RUN pip install -r /tmp/requirements.txt

# Then kvship itself, without its torch-bearing dependencies; the installer leaves with the build stage.
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
 && pip uninstall -y -q pip

# ---- final stage: the base, the venv, a non-root user; no compiler, no pip of ours, no sources
FROM ${BASE}
COPY --from=build /opt/kvship /opt/kvship
# uid/gid 1000, what the pods' securityContext expects; a base may already hold it (Ubuntu's images: "ubuntu")
RUN if getent passwd 1000 >/dev/null; then userdel "$(getent passwd 1000 | cut -d: -f1)"; fi \
 && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
 && groupadd --gid 1000 kvship \
 && useradd --uid 1000 --gid 1000 --no-create-home --home-dir /tmp kvship
USER 1000:1000
WORKDIR /tmp
ENV HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/kvship \
    PATH=/opt/kvship/bin:$PATH
EXPOSE 8080
# kopf's liveness endpoint (--liveness-port): 200 while the operator's event loop runs.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=4)"]
ENTRYPOINT ["kvship"]
CMD ["operator"]
