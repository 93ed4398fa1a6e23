#!/bin/bash
# Two builds alternating in one sitting: host cost, then the emulated ResNet-50 pair, per round.
#   tools/ab_alternate.sh BEFORE_TREE AFTER_TREE OUT_DIR [ROUNDS]
# BEFORE_TREE: e.g. `git worktree add /tmp/before <commit>` with dear/_native*.so copied in (or
# built); each run imports dear from its own tree (PYTHONPATH). Results: OUT_DIR/ab_*_<build>_<round>.*
set -u
before=$1 after=$2 out=$3 rounds=${4:-2}
PY=${PY:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
mkdir -p "$out"
for round in $(seq 1 "$rounds"); do
  for kind in host emu; do
    for build in before after; do
      dir=$after; [ $build = before ] && dir=$before
      if [ $kind = host ]; then
        args="benchmarks.host_cost --blocks 48 --block 4 --warmup 40 --methods none,ddp,dear,dear:schedule=dear"
      else
        args="benchmarks.emulated_bench --setups resnet50:2 --methods ddp,dear --rounds 2 --warmup 6 --iters 5"
      fi
      name=ab_${kind}_${build}_$round
      (cd "$dir" && PYTHONPATH=$dir timeout 1500 "$PY" -m $args --name $name > "$out/$name.log" 2>&1)
      mv "$dir"/benchmarks/results/$name.* "$out"/ 2>/dev/null
      echo "$(date +%T) $name done" >> "$out/progress"
    done
  done
done
