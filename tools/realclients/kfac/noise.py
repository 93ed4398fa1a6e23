"""kfac-pytorch's own rounding noise on its example's ResNet-32 and settings (one process): how far
kfac-pytorch moves from itself when every weight starts one float32 ulp off, beside how far
dear.kfac.KFACPreconditioner is from it. Run with kfac-pytorch 0.4.2 importable and
/tmp/kfacex/varA (run.sh's copy of its examples) on the path: python noise.py STEPS."""

import sys

import kfac
import torch

import dear.kfac

sys.path.insert(0, "/tmp/kfacex/varA")
from examples.vision import cifar_resnet as models  # noqa: E402

torch.set_num_threads(1)


def run(which: str, steps: int, perturb: bool = False) -> dict:
    torch.manual_seed(0)
    model = models.resnet32()
    if perturb:                                    # one float32 ulp on every weight
        with torch.no_grad():
            for q in model.parameters():
                q.copy_(torch.nextafter(q, torch.full_like(q, float("inf"))))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    cls = (kfac.preconditioner.KFACPreconditioner if which == "kfac"
           else dear.kfac.KFACPreconditioner)
    precond = cls(model, factor_update_steps=1, inv_update_steps=10, damping=0.003,
                  factor_decay=0.95, kl_clip=0.001, lr=lambda x: opt.param_groups[0]["lr"],
                  accumulation_steps=1, allreduce_bucket_cap_mb=25, colocate_factors=True,
                  compute_method=kfac.enums.ComputeMethod.EIGEN,
                  grad_worker_fraction=kfac.enums.DistributedStrategy.COMM_OPT, skip_layers=[])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        precond.step()
        opt.step()
    return model.state_dict()


def max_diff(u: dict, v: dict) -> float:
    return max((u[k].float() - v[k].float()).abs().max().item()
               for k in u if u[k].is_floating_point())


if __name__ == "__main__":
    steps = int(sys.argv[1])
    a, b, c = run("kfac", steps), run("dear", steps), run("kfac", steps, perturb=True)
    print(f"{steps} steps: kfac vs dear {max_diff(a, b):.3e}; kfac vs kfac with weights one "
          f"ulp off {max_diff(a, c):.3e}")
