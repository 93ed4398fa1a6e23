#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool; CI has no GPU, so this is the only place the
# CUDA half runs): build dear's extension with CUDA and NCCL against that machine's torch, probe
# the csrc NCCL communicator step by step (a crash names its step, exit included), run the CUDA
# tests and the demo (two CPU ranks on a GPU machine), then SUITE if given.
#   SUITE="tests/test_x.py ..." adds a pytest run of those (-n 14); SUITE_TIMEOUT bounds it.
#   CUDA_TIMEOUT bounds the CUDA tests (-n 4); DEMO=0 leaves the demo out; GPU_BENCH=1 adds
#   benchmarks.gpu_edit_checks (torch vs dear at one rank, its result files copied to $OUT).
#   HOST_COST=1 runs benchmarks.host_cost on the GPU right after the build (plain, DDP and dear
#   at one rank on NCCL, bf16 autocast, ResNet-50 batch 32 and 128, BERT-Base 32 x 128; result
#   files benchmarks/results/gpu_host_cost.* copied to $OUT; HOST_COST_MODELS and
#   HOST_COST_METHODS replace those lists, HOST_COST_BLOCKS the 8 timed blocks); QUANT_KERNELS=1
#   adds benchmarks.quantize_kernels (dear's quantize/dequantize kernels on CPU and GPU, result
#   files gpu_quantize_kernels.* copied to $OUT); PROBES=0 leaves the probes out.
# Last run: 2026-11-28 20:36 UTC on an H200 (torch 2.11+cu130), at 94272cf: 55 CUDA tests passed,
# 1 skipped (nccl4py not installed there), 8 failed at a NaN's payload only (test_quantize's
# CUDA kernels; fixed in the test's comparison after that run, not rerun on a GPU). Also not
# run on a GPU yet: a world of one's single optimizer call (ed24da6), its buckets without a shard
# or collectives (5b31a44, 610f833; test_cuda_torch_dist's training test covers them on NCCL) and
# the one 'averaged' CUDA event a bucket (8f74408).
set -u
OUT=${OUT:-/tmp/dear-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi -L
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
"$PY" -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1
echo "build: pip exit $?"; grep -n " error" "$OUT/build.log" | head -20
"$PY" -m dear.info
if [ "${HOST_COST:-0}" != 0 ]; then
  echo "== benchmarks.host_cost on the GPU"
  timeout "${HOST_COST_TIMEOUT:-240}" "$PY" -m benchmarks.host_cost --device cuda --nproc 1 \
    --no-pin --autocast bf16 --models "${HOST_COST_MODELS:-resnet50@32,resnet50@128,bert_base@32}" \
    --methods "${HOST_COST_METHODS:-none,ddp,dear,dear:collectives_at_one=true}" \
    --warmup 20 --blocks "${HOST_COST_BLOCKS:-8}" --block 10 \
    --name gpu_host_cost 2>&1 | grep -v "^USDT" | tail -16
  cp benchmarks/results/gpu_host_cost.* "$OUT/" 2>/dev/null
fi
if [ "${QUANT_KERNELS:-0}" != 0 ]; then
  echo "== benchmarks.quantize_kernels"
  timeout 120 "$PY" -m benchmarks.quantize_kernels --name gpu_quantize_kernels 2>&1 | tail -14
  cp benchmarks/results/gpu_quantize_kernels.* "$OUT/" 2>/dev/null
fi
if [ "${PROBES:-1}" != 0 ]; then
  for m in raw csrc; do
    timeout 60 "$PY" tools/gpu_probe.py "$m" >"$OUT/probe_$m.log" 2>&1; echo "probe $m: exit $?"
  done
fi
echo "== CUDA tests"
timeout -s INT "${CUDA_TIMEOUT:-300}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --tb=short \
  -n 4 --timeout 280 -m cuda tests 2>&1 | tee "$OUT/cuda.log" | tail -12
if [ "${DEMO:-1}" != 0 ]; then
  echo "== demo"
  timeout 90 "$PY" -m benchmarks.demo --loopback 2>&1 | tail -4
fi
if [ "${GPU_BENCH:-0}" != 0 ]; then
  echo "== benchmarks.gpu_edit_checks"
  timeout 200 "$PY" -m benchmarks.gpu_edit_checks --iters 40 2>&1 | tail -9
  cp benchmarks/results/gpu_edit_checks.* "$OUT/" 2>/dev/null
fi
if [ -n "${SUITE-}" ]; then
  echo "== suite: $SUITE"
  timeout -s INT "${SUITE_TIMEOUT:-200}" "$PY" -m pytest -q -rfE -p no:cacheprovider --tb=short \
    -n 14 --timeout 100 $SUITE >"$OUT/suite.log" 2>&1
  grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/suite.log" | cut -c1-250 | head -40
fi
