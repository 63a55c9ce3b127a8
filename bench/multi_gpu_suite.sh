#!/usr/bin/env bash
# multi_gpu_suite.sh -- the two-GPU run (TP=2, EP=2, PD across GPUs) in one or two device calls; runs ON a
# machine with N >= 2 GPUs of one host (the device tool's nvidia-h100-x2 / nvidia-h200-x2).
#
#   PARTS="tests tp equality" bash bench/multi_gpu_suite.sh        # first call
#   PARTS="ep_layer ep_decode pd" bash bench/multi_gpu_suite.sh     # second call
#
# Carry what bench/gpu_suite.sh needs (.device, .whl).  Setup is gpu_suite.sh's (PARTS=none).  Every part has its
# own time limit (seconds: T_<PART>), writes under /tmp/res/<part>/, and after each part everything so far is packed
# into $OUT/multi_gpu_results.tar.xz, so a call cut off at its limit still brings back what finished.
# Parts:
#   tests      pytest tests/gpu/test_gpu_two_gpus.py tests/gpu/test_gpu_pd_two_gpus.py (TESTS= to pick others)
#   allreduce  bench/all_reduce.py: NCCL vs one-shot / two-shot over peer memory by size, in CUDA graphs
#   equality   bench/tp_equality.py: Llama-3.1-8B shape, dummy weights, TP=2 vs two TP=1 runs, first mismatches
#   equality_fp32  the same in float32 (bf16 rounding of the row-parallel partial sums taken out)
#   tp         bench/decode_latency.py --tp-size $N (Llama-3.1-8B shape) beside one GPU, NCCL time per step
#   tp_p2p     the same TP loops with the small all-reduces one-shot over peer memory (KVSHIP_TP_ALLREDUCE=p2p)
#   ep_layer   bench/moe_layer.py --ep-size $N (Qwen3-30B-A3B layer) beside one GPU
#   ep_decode  bench/decode_latency.py --shape qwen3-30b-a3b --tp-size $N --ep-size $N beside one GPU
#   ep_decode_static  the same EP loops with --ep-dispatch static (no baseline)
#   ep_dispatch  bench/ep_dispatch.py: all_reduce vs static vs two-batch overlap, communication alone and the layer
#   eplb       bench/eplb.py: a skewed Qwen3-30B-A3B layer, plain EP vs 32 redundant experts after a rebalance
#   pp         bench/pp.py: kvship serve --pp-size 2 vs one GPU over /generate (batch 128 and batch 1), and PP=2
#              again under $PP_ENV (default KVSHIP_PP_CHAIN=0: stage 0 waits for the results on its host);
#              PP_ARGS: more bench/pp.py flags (e.g. "--batch 256")
#   tp_http    bench/pp.py --vs "--tp-size N": TP over /generate vs one GPU (batch 64, batch 1), all-reduce
#              KVSHIP_TP_ALLREDUCE=$TP_ALLREDUCE (default p2p)
#   sentinel_ar    bench/all_reduce.py at 8 KiB-1 MiB: the sentinel exchange (plain, and with the norm inside
#              against the push kernel then the norm kernel) beside the push kernel
#   sentinel_http  bench/pp.py TP over /generate, the --vs worker again with KVSHIP_TP_ALLREDUCE_SENTINEL_MAX=1048576
#   sentinel_ep    the EP decode loops (batch 1, 128) with KVSHIP_TP_ALLREDUCE_SENTINEL_MAX=1048576, beside one GPU
#   pd         bench/pd_ttft.py: prefill on GPU 0, decode on GPU 1 (nixl, mooncake) beside unified; KV GB/s
#              against the GPU0->GPU1 copy bandwidth; token-for-token check
#   pd_whole   the same over nixl at 4096 tokens, layer-wise send against the whole-request send (after the
#              forward: the link's own rate)
# NVLink multicast stays off (the device notes: NCCL_NVLS_ENABLE=0 and friends are set on the machine; set again here).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/res
START=$(date +%s); el() { echo $(( $(date +%s) - START )); }
PARTS=${PARTS:-tests tp equality}
N=${N:-2}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

PARTS=none bash bench/gpu_suite.sh > /tmp/res/setup.log 2>&1
tail -4 /tmp/res/setup.log
. /tmp/site/env.sh
[ -d /tmp/kvsrc ] && export PYTHONPATH=/tmp/kvsrc:$PYTHONPATH
exec > >(tee -a /tmp/res/multi_gpu_suite.log) 2>&1
echo "== machine [$(el)s]"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
nvidia-smi topo -m 2>&1 | head -6
python3 -c "import torch; print('visible GPUs', torch.cuda.device_count())"

pack() { tar -C /tmp/res -cf - . | xz -3 -T0 > "$OUT/multi_gpu_results.tar.xz"; }

part() {  # part NAME DEFAULT_LIMIT COMMAND...
  local name=$1 limit=$2; shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  local var="T_${name^^}"; limit=${!var:-$limit}
  mkdir -p "/tmp/res/$name"
  echo "== $name (limit ${limit}s) [$(el)s]"
  timeout -k 10 "$limit" "$@" > "/tmp/res/$name/log" 2>&1
  echo "$name rc=$? [$(el)s]"
  # a part cut off at its limit leaves servers and spawned ranks holding GPU memory: end them before the next
  pkill -9 -f "kvship.app.cli|multiprocessing.spawn|multiprocessing.resource_tracker" 2>/dev/null && sleep 2
  grep -E "^\||PASSED|FAILED|ERROR|SKIPPED|verdict|Traceback|Error" "/tmp/res/$name/log" | cut -c1-240 | tail -40
  pack
}

part tests 200 python3 -m pytest -v -rs -p no:cacheprovider --timeout 190 \
  ${TESTS:-tests/gpu/test_gpu_two_gpus.py tests/gpu/test_gpu_pd_two_gpus.py}
part allreduce 120 python3 bench/all_reduce.py --tp-size "$N" --out /tmp/res/allreduce
part tp 160 python3 bench/decode_latency.py --tp-size "$N" --batch-sizes ${TP_BS:-1,8,32,64} --modes graph \
  --input-len 512 --output-len 128 --profile-bs 1,64 --out /tmp/res/tp
part tp_p2p 90 env KVSHIP_TP_ALLREDUCE=p2p python3 bench/decode_latency.py --tp-size "$N" --no-baseline \
  --batch-sizes ${TP_BS:-1,8,32,64} --modes graph --input-len 512 --output-len 128 --profile-bs 1,64 --out /tmp/res/tp_p2p
part equality 150 python3 bench/tp_equality.py --device cuda --shape llama3-8b --tp-size "$N" --steps 64 \
  --out /tmp/res/equality
part equality_fp32 200 python3 bench/tp_equality.py --device cuda --shape llama3-8b --tp-size "$N" --steps 64 \
  --dtype float32 --out /tmp/res/equality_fp32
part ep_layer 100 python3 bench/moe_layer.py --ep-size "$N" --m 1 16 64 512 2048 4096 8192 --out /tmp/res/ep_layer
part ep_decode 200 env KVSHIP_TP_ALLREDUCE=${TP_ALLREDUCE:-nccl} python3 bench/decode_latency.py --shape qwen3-30b-a3b --tp-size "$N" --ep-size "$N" \
  --batch-sizes 1,32,128 --modes graph --attention-backend triton --input-len 256 --output-len 128 --profile-bs 1 \
  --out /tmp/res/ep_decode
part ep_decode_static 150 python3 bench/decode_latency.py --shape qwen3-30b-a3b --tp-size "$N" --ep-size "$N" \
  --no-baseline --ep-dispatch static --batch-sizes 1,32,128 --modes graph --attention-backend triton \
  --input-len 256 --output-len 128 --out /tmp/res/ep_decode_static
part ep_dispatch 150 python3 bench/ep_dispatch.py --ep-size "$N" --m ${EP_M:-1 32 128 4096 8192} --out /tmp/res/ep_dispatch
part eplb 120 python3 bench/eplb.py --device cuda --ep-size "$N" --experts 128 --redundant 32 --topk 8 --hidden 2048 \
  --inter 768 --tokens 4096 --out /tmp/res/eplb
part pp 360 python3 bench/pp.py --vs-env "${PP_ENV:-KVSHIP_PP_CHAIN=0}" ${PP_ARGS:-} --json /tmp/res/pp/pp.json
part tp_http 200 env KVSHIP_TP_ALLREDUCE=${TP_ALLREDUCE:-p2p} python3 bench/pp.py --vs "--tp-size $N" --batch 64 \
  --json /tmp/res/tp_http/tp_http.json
part sentinel_ar 90 python3 bench/all_reduce.py --tp-size "$N" --sizes 8192 16384 65536 524288 1048576 \
  --out /tmp/res/sentinel_ar
part sentinel_http 260 python3 bench/pp.py --vs "--tp-size $N" --vs-env KVSHIP_TP_ALLREDUCE_SENTINEL_MAX=1048576 \
  --batch 64 --json /tmp/res/sentinel_http/tp_http.json
part sentinel_ep 200 env KVSHIP_TP_ALLREDUCE_SENTINEL_MAX=1048576 python3 bench/decode_latency.py \
  --shape qwen3-30b-a3b --tp-size "$N" --ep-size "$N" --batch-sizes 1,128 --modes graph --skip-hf \
  --out /tmp/res/sentinel_ep
part pd 240 python3 bench/pd_ttft.py --device cuda --shape llama3-8b --backend nixl --backend mooncake \
  --prompt-len 512 4096 --repeats 3 --warmup 1 --check-tokens 32 --out /tmp/res/pd
part pd_whole 150 python3 bench/pd_ttft.py --device cuda --shape llama3-8b --backend nixl --prompt-len 4096 \
  --repeats 3 --warmup 1 --variant whole=--no-disaggregation-layerwise --out /tmp/res/pd_whole
echo "== end [$(el)s]"
pack; ls -la "$OUT"
