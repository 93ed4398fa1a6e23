"""Elastic training with dear's own API (docs/elastic.md): a small classifier on synthetic
data that goes on when nodes are lost or added.

On one machine, two "nodes" (run each line in its own terminal; kill one, start a third):

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 DEAR_ELASTIC_DIR=/tmp/dear-elastic-demo
    torchrun --nnodes 1:3 --nproc-per-node 1 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29400 --rdzv-id demo \\
        --rdzv-conf last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5 \\
        examples/elastic/train.py --epochs 5

On a cluster, the same on every node with the endpoint on a host that outlives the job and
DEAR_ELASTIC_DIR on a shared file system.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import dear
import dear.elastic

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--epochs", type=int, default=5)
p.add_argument("--batch-size", type=int, default=32, help="per rank")
p.add_argument("--lr", type=float, default=0.01, help="per rank: scaled by the world size")
p.add_argument("--samples", type=int, default=4096)
p.add_argument("--commit-every", type=int, default=4, help="batches between commits")
args = p.parse_args()

dear.init()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
features = torch.randn(args.samples, 32, generator=g)
labels = (features[:, :4].sum(dim=1) > 0).long() + 2 * (features[:, 4] > 0).long()
dataset = torch.utils.data.TensorDataset(features, labels)

model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = dear.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=args.lr * dear.size(), momentum=0.9), model=model)
sampler = dear.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

state = dear.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)


def on_reset() -> None:
    """After every change of the workers: the learning rate for the new size."""
    for group in optimizer.param_groups:
        group["lr"] = args.lr * dear.size()


state.register_reset_callbacks([on_reset])


@dear.elastic.run
def train(state: dear.elastic.State) -> None:
    while state.epoch < args.epochs:
        for x, y in loader:                       # what is left of the epoch, for this size
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            state.batch += 1
            sampler.record_batch(state.batch, args.batch_size)
            if state.batch % args.commit_every == 0:
                state.commit()                    # may end the process: nothing is lost
        if dear.rank() == 0:
            print(f"epoch {state.epoch}: loss {loss.item():.4f} on {dear.size()} ranks",
                  flush=True)
        state.epoch += 1
        sampler.set_epoch(state.epoch)            # at the END of the epoch
        state.batch = 0
        state.commit()


train(state)
if dear.rank() == 0:
    print("done", flush=True)
dear.shutdown()
