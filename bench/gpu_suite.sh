#!/usr/bin/env bash
# gpu_suite.sh -- everything the GPU work needs, in one device call (runs ON the GPU machine).
#
#   bash bench/gpu_suite.sh                  # PARTS="tests bench" by default
#   PARTS="tests" bash bench/gpu_suite.sh
#
# Expects in the working tree (carried with the device tool's `carry`):
#   $BUNDLE/ (default .device)  device-setup.sh + fi.tar.xz + fi_aot.tar.xz [+ mc/nx/py bundles]
#   .whl/*.whl                  extra wheels the bundle lacks (gguf, xgrammar, orjson: the router needs it;
#                               jsonschema + attrs, referencing, jsonschema-specifications, rpds-py: the grammar tests;
#                               httptools: uvicorn[standard], what the product installs; the image has only h11), cp312
#   .devmodel/*.gguf            optional SmolLM2 layer subset (bench/smollm2_subset.py) for the tests
# Parts:
#   tests       pytest tests/gpu                      -> $OUT/gpu_suite.log (+ summary)
#   bench       bench/decode_latency.py (8B shape)    -> $OUT/decode_latency.{json,md}
#   smoke       bench/decode_latency.py, short run    -> $OUT/decode_latency.{json,md}
#   offline     bench/offline_throughput.py on cuda   -> $OUT/offline_throughput.log
#   kvtransfer  bench/kv_transfer.py --device cuda    -> $OUT/kv_transfer.log (if the script exists)
#   script      bash $SCRIPT (more commands for this call, after the setup)
#   ab          decode_latency from a baseline tree (BASE_TREE) vs this tree, AB_ARGS, AB_ROUNDS -> $OUT/ab_*.json
# Knobs: BENCH_ARGS (extra decode_latency args), TEST_ARGS (extra pytest args), TEST_PATHS (default tests/gpu;
#        list a file first to run it first), TEST_TIMEOUT, BENCH_TIMEOUT (s).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$(date +%s); el() { echo $(( $(date +%s) - START )); }
PARTS=${PARTS:-tests bench}
BUNDLE=${BUNDLE:-.device}
exec > >(tee -a "$OUT/gpu_suite.log") 2>&1

echo "== probe [$(el)s]"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"

echo "== setup [$(el)s]"
SKIP_VERSIONS=1 bash "$BUNDLE/device-setup.sh" | tail -3
. /tmp/site/env.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING | tail -3
if ! python3 -c "import kvship.engine.config" 2>/dev/null; then
  # fallback: kvship is a namespace package; link its folders under a path entry
  mkdir -p /tmp/kvsrc/kvship
  for d in engine prefill decode router operator common app; do ln -sfn "$PWD/$d" "/tmp/kvsrc/kvship/$d"; done
  export PYTHONPATH=/tmp/kvsrc:$PYTHONPATH
fi
python3 -c "import flashinfer, kvship.engine.model_runner; print('flashinfer', flashinfer.__version__, 'kvship ok')"
GGUF=$(ls .devmodel/*.gguf 2>/dev/null | head -1)
[ -n "$GGUF" ] && export KVSHIP_SMOLLM2_GGUF=$PWD/$GGUF && echo "SmolLM2 for tests: $GGUF"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ls /tmp/fiws/.cache/flashinfer 2>/dev/null | head -1 >/dev/null
find /tmp/fiws -name '*.so' 2>/dev/null | sort > /tmp/jit_before.txt

echo "== PDL probe [$(el)s]"
# our Triton kernels can launch with programmatic dependent launch on Hopper (KVSHIP_PDL=1, opt-in): check that
# it compiles and computes here before anything else relies on it
if ! KVSHIP_PDL=1 python3 - <<'PY'
import torch
from kvship.engine.layers import fused_ops_cuda as f, skinny_gemm_cuda as sg
x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16)
nw = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
h = f.rmsnorm(x, nw, 1e-5)
y = sg.linear(h, w)
ref = h.float() @ w.float().t()
err = ((y.float() - ref).norm() / ref.norm()).item()
torch.cuda.synchronize()
print("PDL probe ok: use_pdl", f.use_pdl(x), "rel err", err)
assert err < 1e-2
PY
then
  echo "!! PDL probe FAILED: do not set KVSHIP_PDL=1 here"; export KVSHIP_PDL=0
fi

if [[ " $PARTS " == *" tests "* ]]; then
  echo "== tests/gpu [$(el)s]"
  timeout -k 10 "${TEST_TIMEOUT:-480}" python3 -m pytest ${TEST_PATHS:-tests/gpu} -v -rs --timeout 240 -p no:cacheprovider \
    ${TEST_ARGS:-} > /tmp/gpu_tests.log 2>&1
  echo "pytest rc=$?"
  grep -E "PASSED|FAILED|ERROR|SKIPPED" /tmp/gpu_tests.log | sed 's/ *\[ *[0-9]*%\]//' | cut -c1-220
  grep -E "^(FAILED|ERROR)|Error|assert" /tmp/gpu_tests.log | head -40 | cut -c1-300
  tail -3 /tmp/gpu_tests.log
  cp /tmp/gpu_tests.log "$OUT/gpu_tests.log"
fi

if [[ " $PARTS " == *" script "* ]]; then
  # any further commands of this call ($SCRIPT, a bash file carried with the tree), after the setup above
  echo "== script $SCRIPT [$(el)s]"
  bash "$SCRIPT"
  echo "script rc=$?"
fi

if [[ " $PARTS " == *" ab "* ]]; then
  # A/B: the decode benchmark from a baseline checkout's sources ($BASE_TREE holds its engine/ prefill/ decode/
  # bench/), alternating with this tree, same arguments ($AB_ARGS); only the JSON comes back
  echo "== decode_latency A/B against $BASE_TREE [$(el)s]"
  mkdir -p /tmp/kvbase/kvship /tmp/ab
  for d in engine prefill decode; do ln -sfn "$PWD/$BASE_TREE/$d" "/tmp/kvbase/kvship/$d"; done
  for i in ${AB_ROUNDS:-1 2}; do
    for side in base new; do
      if [ $side = base ]; then PP=/tmp/kvbase:${PYTHONPATH:-}; SCRIPT=$BASE_TREE/bench/decode_latency.py
      else PP=${PYTHONPATH:-}; SCRIPT=bench/decode_latency.py; fi
      PYTHONPATH=$PP python3 -c "import kvship.engine.model_runner as m; print('$side uses', m.__file__)"
      PYTHONPATH=$PP timeout -k 10 300 python3 $SCRIPT ${AB_ARGS:-} --out /tmp/ab/$side$i > /tmp/ab/$side$i.log 2>&1
      rc=$?; echo "$side$i rc=$rc"; grep -E "^\|" /tmp/ab/$side$i.log | head -20
      [ $rc = 0 ] || tail -15 /tmp/ab/$side$i.log
      cp /tmp/ab/$side$i/decode_latency.json "$OUT/ab_$side$i.json" 2>/dev/null
    done
  done
fi

if [[ " $PARTS " == *" smoke "* ]]; then
  echo "== decode_latency smoke [$(el)s]"
  timeout -k 10 300 python3 bench/decode_latency.py --batch-sizes 1,64 --output-len 64 --skip-hf \
    --modes graph,eager,graph+overlap --profile-bs 1 --out "$OUT" ${BENCH_ARGS:-}
  echo "decode_latency rc=$?"
fi

if [[ " $PARTS " == *" bench "* ]]; then
  echo "== decode_latency [$(el)s]"
  timeout -k 10 "${BENCH_TIMEOUT:-420}" python3 bench/decode_latency.py --out "$OUT" ${BENCH_ARGS:-}
  echo "decode_latency rc=$?"
fi

if [[ " $PARTS " == *" offline "* ]]; then
  echo "== offline_throughput [$(el)s]"
  MD=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import decode_latency as d; print(d.write_model_dir('llama3-8b', '/tmp'))")
  timeout -k 10 "${OFFLINE_TIMEOUT:-300}" python3 bench/offline_throughput.py --device cuda --model-path "$MD" \
    --load-format dummy --attention-backend flashinfer ${OFFLINE_ARGS:---batch-sizes 1 64 --input-len 512 --output-len 128} \
    > "$OUT/offline_throughput.log" 2>&1
  echo "offline_throughput rc=$?"; grep -v "it/s\]" "$OUT/offline_throughput.log" | tail -15
fi

if [[ " $PARTS " == *" kvtransfer "* ]]; then
  if [ -f bench/kv_transfer.py ]; then
    echo "== kv_transfer [$(el)s]"
    timeout -k 10 "${KV_TIMEOUT:-180}" python3 bench/kv_transfer.py --device cuda --out "$OUT/kv_transfer_cuda.json" \
      ${KV_ARGS:-} > "$OUT/kv_transfer.log" 2>&1
    echo "kv_transfer rc=$?"; tail -25 "$OUT/kv_transfer.log"
  else
    echo "== kv_transfer: bench/kv_transfer.py absent"
  fi
fi

# FlashInfer modules JIT-built in this run (not in the carried AOT cache): bring them back
find /tmp/fiws -name '*.so' 2>/dev/null | sort > /tmp/jit_after.txt
NEW=$(comm -13 /tmp/jit_before.txt /tmp/jit_after.txt)
if [ -n "$NEW" ]; then
  echo "== newly JIT-built flashinfer modules:"; echo "$NEW"
  rm -rf /tmp/aotnew; mkdir -p /tmp/aotnew
  for so in $NEW; do n=$(basename "$(dirname "$so")"); mkdir -p "/tmp/aotnew/$n"; cp -p "$so" "/tmp/aotnew/$n/"; done
  tar -C /tmp/aotnew -cf - . | xz -6 -T0 > "$OUT/fi_jit_new.tar.xz"
fi
echo "== end [$(el)s]"; ls -la "$OUT"
