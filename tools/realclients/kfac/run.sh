#!/bin/bash
# kfac-pytorch v0.4.2 CIFAR-10 example: A = as published (DDP), B = dear's optimizer swap,
# C = the one-line swap of the preconditioner (kfac.preconditioner.KFACPreconditioner ->
# dear.kfac.KFACPreconditioner; kfac-pytorch's own LambdaParamScheduler drives it).
set -u
cd /tmp/kfacex
PY=/work/main/.venv/bin/python
TORCHRUN=/work/main/.venv/bin/torchrun
export OMP_NUM_THREADS=1
for V in A B C; do
  rm -rf var$V runs/$V; mkdir -p var$V runs/$V
  cp -r src/kfac src/examples src/kfac_pytorch-0.4.2.dist-info var$V/
  (cd var$V && patch -s -p1 < ../cpu_data.patch) || exit 1
  if [ $V = B ]; then (cd var$V && patch -s -p1 < ../dear.patch) || exit 1; fi
  if [ $V = C ]; then
    sed -i -e 's/^import kfac$/import kfac\nimport dear.kfac/' \
      -e 's/preconditioner = kfac.preconditioner.KFACPreconditioner(/preconditioner = dear.kfac.KFACPreconditioner(/' \
      var$V/examples/vision/optimizers.py
    grep -q "dear.kfac.KFACPreconditioner(" var$V/examples/vision/optimizers.py || exit 1
  fi
done
for V in A B C; do
  PORT=$($PY -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  echo "=== variant $V (port $PORT)"
  ( cd var$V && FINAL_STATE=/tmp/kfacex/runs/$V/final_rank{rank}.pt PYTHONPATH=/tmp/kfacex/var$V \
    timeout -k 10 600 $TORCHRUN --nproc_per_node 2 --master_addr 127.0.0.1 --master_port $PORT \
      examples/torch_cifar10_resnet.py --backend gloo --no-cuda --batch-size 16 --val-batch-size 16 \
      --epochs 2 --log-dir /tmp/kfacex/runs/$V/logs ) > runs/$V/log.txt 2>&1
  echo "exit code $?"
  grep -E '^FINAL|dear|Warning|Error|Traceback' runs/$V/log.txt
done
$PY compare.py /tmp/kfacex/runs
