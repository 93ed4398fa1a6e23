#!/usr/bin/env bash
# Real clients, DDP vs dear: torchvision references/classification/train.py and timm train.py,
# each run on 2 CPU ranks (torchrun, gloo) once as published (DDP, + tv_cpu/timm_cpu patch) and
# once changed as dear's README says (+ tv_dear/timm_dear patch); compare.py compares the final
# state dicts every rank saves. One run at a time; each under `timeout -k 10 300`.
#
#   ./run_all.sh [OUT_DIR]        (default /tmp/realclients/out/<date>)
#   ONLY=timm ./run_all.sh        the timm runs alone (src/tv/ not needed)
#   EXTRA_PATH=DIR                a folder with timm and torchvision (pip install --target DIR
#                                 --no-deps ...) put on PYTHONPATH after dear: no scratch venv
#
# Inputs (all in this folder):
#   src/tv/    torchvision references/classification as published (pytorch/vision 428a54c, 2025-06-03;
#              last change to that folder e2aff7e, 2024-07-08)
#   src/timm/  timm train.py at tag v1.0.28 (8ef7380)
#   patches/   tv_cpu.patch, tv_dear.patch (on top of tv_cpu), timm_cpu.patch, timm_dear.patch
#   pyshim/sitecustomize.py   lets `import torchvision` work with the CPU torch (see that file)
#   make_data.py              the tiny ImageFolder data set
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PY:-/work/main/.venv/bin/python}
TORCHRUN=${TORCHRUN:-/work/main/.venv/bin/torchrun}
OUT=${1:-$HERE/out/$(date +%Y%m%d-%H%M%S)}
DATA=$HERE/data
BUILD=$OUT/build
mkdir -p "$OUT" "$BUILD"
DEAR_SRC=${DEAR_SRC:-/work/main}
export OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1

# --- freeze the dear under test: copy $DEAR_SRC/dear (with its built _native .so) once, so that
# edits to the working tree during this run cannot mix versions; it goes first on PYTHONPATH.
rm -rf "$OUT/dear_pkg"; mkdir -p "$OUT/dear_pkg"
cp -r "$DEAR_SRC/dear" "$OUT/dear_pkg/dear"
find "$OUT/dear_pkg" -name __pycache__ -prune -exec rm -rf {} +
{ echo "dear from $DEAR_SRC, copied $(date -u +%FT%TZ)"
  git -C "$DEAR_SRC" log -1 --format='HEAD %H %ad %s' 2>/dev/null
  echo "uncommitted changes under dear/:"; git -C "$DEAR_SRC" status --short -- dear 2>/dev/null
  echo "sha256 of the copied tree: $(cd "$OUT/dear_pkg" && find dear -type f | sort | xargs sha256sum | sha256sum | cut -c1-16)"
} > "$OUT/dear_version.txt"
export PYTHONPATH=$HERE/pyshim:$OUT/dear_pkg${EXTRA_PATH:+:$EXTRA_PATH}
ONLY=${ONLY:-}

# --- build the four script variants from the published sources and the patches -------------
build() {  # build NAME SRC PATCH...
    local name=$1 src=$2; shift 2
    rm -rf "$BUILD/$name"; cp -r "$src" "$BUILD/$name"
    for p in "$@"; do (cd "$BUILD/$name" && patch -s -p1 < "$p") || { echo "patch $p failed"; exit 1; }; done
}
if [ "$ONLY" != timm ]; then
build tv_ddp    "$HERE/src/tv"   "$HERE/patches/tv_cpu.patch"
build tv_dear   "$HERE/src/tv"   "$HERE/patches/tv_cpu.patch" "$HERE/patches/tv_dear.patch"
fi
build timm_ddp  "$HERE/src/timm" "$HERE/patches/timm_cpu.patch"
build timm_dear "$HERE/src/timm" "$HERE/patches/timm_cpu.patch" "$HERE/patches/timm_dear.patch"

[ -d "$DATA/train" ] || "$PY" "$HERE/make_data.py" "$DATA"

free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run SCENARIO VARIANT(ddp|dear|ddp2) SCRIPT_KIND(tv|timm) ARGS...   -> $OUT/SCENARIO/VARIANT_rank{0,1}.pt, .log
run() {
    local sc=$1 var=$2 kind=$3; shift 3
    local dir=$BUILD/${kind}_${var%2}   # ddp2 = ddp script again
    mkdir -p "$OUT/$sc"
    local log=$OUT/$sc/$var.log port; port=$(free_port)
    local cmd=(timeout -k 10 300 "$TORCHRUN" --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$port"
               train.py "$@")
    echo "\$ (cd $dir && FINAL_STATE=$OUT/$sc/${var}_rank{rank}.pt ${cmd[*]})" > "$log"
    local t0=$SECONDS
    (cd "$dir" && FINAL_STATE="$OUT/$sc/${var}_rank{rank}.pt" "${cmd[@]}") >> "$log" 2>&1
    local rc=$?
    printf '%-14s %-5s rc=%-3s %4ss  %s\n' "$sc" "$var" "$rc" "$((SECONDS - t0))" "$log" | tee -a "$OUT/runs.txt"
    return 0
}

TV_COMMON=(--data-path "$DATA" --device cpu --model resnet18 -b 8 -j 0 --lr 0.01 --print-freq 1
           --lr-scheduler steplr --lr-step-size 1 --lr-gamma 0.5
           --train-crop-size 32 --val-resize-size 36 --val-crop-size 32)
TIMM_COMMON=(--data-dir "$DATA" --train-split train --val-split val --model resnet18 --num-classes 5
             --img-size 32 -b 8 --workers 1 --device cpu --no-prefetcher --opt sgd --lr 0.01
             --warmup-epochs 0 --seed 0 --log-interval 1 --checkpoint-hist 1)

: > "$OUT/runs.txt"
for var in ddp dear ddp2; do
    [ "$ONLY" = timm ] && break
    # (a) plain, StepLR
    run tv_a "$var" tv "${TV_COMMON[@]}" --epochs 2 --output-dir "$OUT/tv_a/ckpt_$var"
done
for var in ddp dear; do
    [ "$ONLY" = timm ] && break
    # (b) --model-ema (an EMA update every step)
    run tv_b "$var" tv "${TV_COMMON[@]}" --epochs 2 --model-ema --model-ema-steps 1 --model-ema-decay 0.99 \
        --output-dir "$OUT/tv_b/ckpt_$var"
    # (c) 2 epochs saving checkpoints, then --resume for a third
    run tv_c_p1 "$var" tv "${TV_COMMON[@]}" --epochs 2 --output-dir "$OUT/tv_c/ckpt_$var"
    run tv_c "$var" tv "${TV_COMMON[@]}" --epochs 3 --output-dir "$OUT/tv_c/ckpt_$var" \
        --resume "$OUT/tv_c/ckpt_$var/checkpoint.pth"
done
for var in ddp dear ddp2; do
    # (a) plain, cosine schedule
    run timm_a "$var" timm "${TIMM_COMMON[@]}" --epochs 2 --sched cosine --min-lr 1e-4 \
        --output "$OUT/timm_a" --experiment "ckpt_$var"
done
for var in ddp dear; do
    # diagnostic for (a): timm's default --dist-bn reduce all-reduces BN buffers after each epoch;
    # here it is off, to see whether the buffer difference comes from that step
    run timm_a_nodistbn "$var" timm "${TIMM_COMMON[@]}" --epochs 2 --sched cosine --min-lr 1e-4 --dist-bn "" \
        --output "$OUT/timm_a_nodistbn" --experiment "ckpt_$var"
done
for var in ddp dear; do
    # (b) --model-ema
    run timm_b "$var" timm "${TIMM_COMMON[@]}" --epochs 2 --sched step --decay-epochs 1 --decay-rate 0.5 \
        --model-ema --model-ema-decay 0.9 --output "$OUT/timm_b" --experiment "ckpt_$var"
    # (c) 2 epochs saving checkpoints, then --resume last.pth.tar for a third
    run timm_c_p1 "$var" timm "${TIMM_COMMON[@]}" --epochs 2 --sched step --decay-epochs 1 --decay-rate 0.5 \
        --output "$OUT/timm_c" --experiment "ckpt_$var"
    run timm_c "$var" timm "${TIMM_COMMON[@]}" --epochs 3 --sched step --decay-epochs 1 --decay-rate 0.5 \
        --output "$OUT/timm_c" --experiment "ckpt_${var}_resumed" --resume "$OUT/timm_c/ckpt_$var/last.pth.tar"
done

echo
echo "== runs (rc 0 = ok; 124/137 = timeout) =="
cat "$OUT/runs.txt"
echo
echo "== max |difference| of the final state dicts =="
SCENARIOS="tv_a tv_b tv_c_p1 tv_c timm_a timm_a_nodistbn timm_b timm_c_p1 timm_c"
[ "$ONLY" = timm ] && SCENARIOS="timm_a timm_a_nodistbn timm_b timm_c_p1 timm_c"
"$PY" "$HERE/compare.py" "$OUT" $SCENARIOS | tee "$OUT/table.txt"
echo
echo "== dear under test =="; cat "$OUT/dear_version.txt"
echo
echo "== errors in the logs =="
grep -l "Traceback" "$OUT"/*/*.log 2>/dev/null || echo "(no tracebacks)"
