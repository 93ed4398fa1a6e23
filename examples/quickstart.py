"""Quick start: data-parallel training with dear. Run with
    torchrun --nproc_per_node 2 examples/quickstart.py
(or plain `python examples/quickstart.py` for a single process)."""

import torch
import torch.nn.functional as F

import dear

dear.init()                                   # torchrun's env -> Gloo on CPU, NCCL on GPU
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

optimizer = dear.DistributedOptimizer(optimizer, model=model)   # the one-line change
dear.broadcast_optimizer_state(optimizer, root_rank=0)

g = torch.Generator().manual_seed(dear.rank())  # each rank reads its own shard of the data
for step in range(50):
    x = torch.randn(32, 20, generator=g)
    y = (x[:, 0] > 0).long()
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()                          # update lands in the next forward pass

model.eval()                                  # evaluation applies any pending update first
accuracy = (model(x).argmax(1) == y).float().mean()
print(f"rank {dear.rank()}/{dear.size()}: loss {dear.allreduce(loss.detach()).item():.4f}, "
      f"accuracy {dear.allreduce(accuracy).item():.2f}")
torch.save(model.state_dict(), f"/tmp/dear-quickstart-{dear.rank()}.pt")
dear.shutdown()
