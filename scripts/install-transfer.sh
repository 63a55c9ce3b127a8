#!/usr/bin/env bash
# CPU builds of the KV transfer backends (mooncake over its tcp protocol, nixl over
# UCX shared memory).  Idempotent.  Keep Debian's ibverbs-providers uninstalled:
# it makes UCX crash at exit (the tests also set UCX_MODULES=^ib).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
  else
    echo "warning: libibverbs1 is missing and this is not root; mooncake tests will skip" >&2
  fi
fi
$PY -c "import mooncake.engine" 2>/dev/null || $PY -m pip install -q mooncake-transfer-engine-non-cuda
$PY -c "import nixl._api" 2>/dev/null || $PY -m pip install -q nixl
