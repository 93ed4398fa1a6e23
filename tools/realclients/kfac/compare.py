"""Max |difference| of the final state dicts of kfac-pytorch's example, A (DDP) vs B (dear's
optimizer) vs C (dear.kfac.KFACPreconditioner in place of kfac-pytorch's, under DDP)."""
import os
import sys

import torch

d = sys.argv[1]
S = {(v, r): torch.load(f"{d}/{v}/final_rank{r}.pt") for v in "ABC" for r in (0, 1)
     if os.path.exists(f"{d}/{v}/final_rank{r}.pt")}


def md(a, b, params_only=False):
    m = 0.0
    for k in a:
        if not a[k].is_floating_point():
            if not torch.equal(a[k], b[k]):
                print("  int buffer differs:", k)
            continue
        if params_only and "running_" in k:
            continue
        m = max(m, (a[k] - b[k]).abs().max().item())
    return m


for name, x, y in [("A r0 vs A r1", ("A", 0), ("A", 1)), ("B r0 vs B r1", ("B", 0), ("B", 1)),
                   ("A r0 vs B r0", ("A", 0), ("B", 0)), ("A r1 vs B r1", ("A", 1), ("B", 1)),
                   ("C r0 vs C r1", ("C", 0), ("C", 1)), ("A r0 vs C r0", ("A", 0), ("C", 0))]:
    if x not in S or y not in S:
        print(f"{name}: missing")
        continue
    print(f"{name}: max|diff| all state {md(S[x], S[y]):.3e}, "
          f"params only {md(S[x], S[y], True):.3e}")
