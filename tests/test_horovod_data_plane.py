"""The Horovod backend's two data planes, against references computed independently.

DEAR_HOROVOD_DATA_PLANE=gloo (the default): reduce-scatters and all-gathers run dear's pairwise
exchange on private Gloo groups started through Horovod; =horovod: Horovod's own collectives.
Checked: results against sums recomputed from every rank's regenerated input, the gathered bits
equal on every rank, bfloat16 carried by the Gloo plane (refused clearly by the Horovod one), the
user's own torch.distributed default group untouched (DDP trains on it beside dear, with a
bfloat16 layer, to the same parameters), and an unreachable rendezvous reported on every rank
instead of a hang. Like test_horovod.py, these fail (never skip) without Horovod."""

from __future__ import annotations

import hashlib
import os
import sys

import torch
import torch.nn.functional as F

from tests.horovod_launch import run_horovod

PLANES = {"gloo": "horovod-gloo-pairwise", "horovod": "horovod"}
SHARDS = (1, 7, 1001, 250_003)


def _input(dtype: torch.dtype, numel: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * seed + rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
    return ((0.5 + 0.5 * torch.rand(numel, generator=g, dtype=torch.float64))
            * (torch.randint(0, 2, (numel,), generator=g) * 2 - 1)).to(dtype)


def _sum(dtype: torch.dtype, numel: int, n: int, seed: int) -> torch.Tensor:
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    return sum(_input(dtype, numel, r, seed).to(wide) for r in range(n)).to(dtype)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.dtype != want.dtype or got.shape != want.shape:
        return float("inf")
    return (got.double() - want.double()).abs().max().item() if got.numel() else 0.0


def collectives(plane: str) -> dict:
    """Rank body: every dtype and shard size through one data plane, several in flight."""
    import torch.distributed as dist

    import dear
    from dear.comm.runtime import communicator
    os.environ["DEAR_HOROVOD_DATA_PLANE"] = plane
    dear.init()
    comm, n, me = communicator(), dear.size(), dear.rank()
    out: dict = {"name": comm.name, "errors": {}, "digests": {},
                 "torch_dist_initialized": dist.is_initialized()}
    dtypes = [torch.float32, torch.float64, torch.float16, torch.int64]
    if plane == "gloo":
        dtypes.append(torch.bfloat16)
    seed, pending = 0, []
    for dtype in dtypes:
        for shard in SHARDS:
            seed += 1
            x = _input(dtype, n * shard, me, seed)
            o = torch.full((shard,), 3, dtype=dtype)
            pending.append((f"{dtype} {shard}", seed, x, o, comm.reduce_scatter(x, o)))
    gathers = []
    for key, seed, x, o, work in reversed(pending):           # waited out of order
        work.wait()
        want = _sum(o.dtype, n * o.numel(), n, seed)
        eps = torch.finfo(o.dtype).eps if o.dtype.is_floating_point else 0.0
        out["errors"][f"rs {key}"] = (_err(o, want.view(n, -1)[me]), n * n * eps)
        g = torch.zeros(n * o.numel(), dtype=o.dtype)
        gathers.append((key, want, g, comm.all_gather(o, g)))
    for key, want, g, work in gathers:
        work.wait()
        out["errors"][f"ag {key}"] = (_err(g, want), n * n * (torch.finfo(g.dtype).eps
                                                             if g.dtype.is_floating_point else 0))
        out["digests"][key] = hashlib.sha256(g.view(torch.uint8).numpy().tobytes()).hexdigest()
    # A reduce-scatter in pieces (a bucket larger than the fusion threshold), in flight at once
    x, shard = _input(torch.float32, n * 1001, me, 97), 1001
    whole, o = torch.empty(shard), torch.full((shard,), 3.0)
    comm.reduce_scatter(x, whole).wait()
    for work in [comm.reduce_scatter_columns(x, o, s, min(300, shard - s))
                 for s in range(0, shard, 300)]:
        work.wait()
    out["errors"]["rs in pieces"] = (_err(o, whole), 0.0)
    if plane == "gloo":                        # Horovod has no bfloat16: the groups carry it
        t = _input(torch.bfloat16, 1001, me, 99)
        comm.all_reduce(t).wait()
        out["errors"]["all_reduce bf16"] = (_err(t, _sum(torch.bfloat16, 1001, n, 99)),
                                            n * n * torch.finfo(torch.bfloat16).eps)
        t = _input(torch.bfloat16, 1001, me, 98)
        comm.broadcast(t, n - 1).wait()
        out["errors"]["broadcast bf16"] = (_err(t, _input(torch.bfloat16, 1001, n - 1, 98)), 0.0)
    dear.shutdown()
    out["torch_dist_initialized"] |= dist.is_initialized()
    return out


def _check_collectives(results: list[dict], plane: str) -> None:
    for rank, res in enumerate(results):
        assert res["name"] == PLANES[plane], res["name"]
        assert not res["torch_dist_initialized"], "dear took torch.distributed's default group"
        bad = {k: v for k, v in res["errors"].items() if not v[0] <= v[1]}
        assert not bad, f"rank {rank}, {plane} plane: |error| > tolerance: {bad}"
    assert results[0]["digests"] == results[1]["digests"], "ranks gathered different bits"


def test_both_data_planes_against_local_sums(tmp_path) -> None:
    script = tmp_path / "coll.py"
    script.write_text("import torch, horovod.torch as hvd\n"
                      "from tests.test_horovod_data_plane import collectives\n"
                      "hvd.init()\nr = {p: collectives(p) for p in ('gloo', 'horovod')}\n"
                      f"torch.save(r, {str(tmp_path)!r} + f'/{{hvd.rank()}}.pt')\n")
    run_horovod([str(script)], np=2, timeout=120)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    assert any("bfloat16" in k for k in results[0]["gloo"]["errors"])
    for plane in PLANES:
        _check_collectives([res[plane] for res in results], plane)


class BF16Net(torch.nn.Module):
    """fp32 and bfloat16 layers (Horovod alone cannot reduce the latter)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(24, 32)
        self.b = torch.nn.Linear(32, 32).to(torch.bfloat16)
        self.c = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x)).bfloat16())).float()
        return self.c(h)


def beside_user_ddp() -> dict:
    """Rank body: the user runs DDP on torch.distributed's default group (Gloo) in the same
    processes; dear on the Horovod backend trains the same model; both end equal, and dear
    left the user's group alone (no group registered, the default group still works)."""
    import horovod.torch as hvd
    import torch.distributed as dist

    import dear
    from tests.workloads import batch
    hvd.init()
    port = hvd.broadcast_object(_free_port() if hvd.rank() == 0 else None, 0, name="port")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())
    groups_before = len(dist.distributed_c10d._world.pg_map)
    dear.init(backend="horovod")               # auto would pick the user's torch group
    name = dear.comm.runtime.communicator().name
    groups_after = len(dist.distributed_c10d._world.pg_map)
    params = {}
    for impl in ("ddp", "dear"):
        model = BF16Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        net = model
        if impl == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
        else:
            opt = dear.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                            model=model)
        for step in range(4):
            opt.zero_grad()
            x, y = batch(step, hvd.size(), hvd.rank())
            F.mse_loss(net(x), y).backward()
            opt.step()
        if impl == "dear":
            opt.synchronize()
        params[impl] = {k: v.clone() for k, v in model.state_dict().items()}
    dear.shutdown()
    check = torch.ones(1)
    dist.all_reduce(check)                     # the user's group still works
    dist.destroy_process_group()
    return {"name": name, "groups": (groups_before, groups_after), "params": params,
            "check": check.item()}


def _free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_bfloat16_beside_the_users_torch_distributed(tmp_path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text("import torch, horovod.torch as hvd\n"
                      "from tests.test_horovod_data_plane import beside_user_ddp\n"
                      "r = beside_user_ddp()\n"
                      f"torch.save(r, {str(tmp_path)!r} + f'/{{hvd.rank()}}.pt')\n")
    run_horovod([str(script)], np=2, timeout=120)
    for rank in range(2):
        res = torch.load(tmp_path / f"{rank}.pt")
        assert res["name"] == PLANES["gloo"]
        assert res["groups"][0] == res["groups"][1], "dear registered a torch.distributed group"
        assert res["check"] == 2.0
        ddp, ours = res["params"]["ddp"], res["params"]["dear"]
        assert ddp["b.weight"].dtype == torch.bfloat16
        for k in ddp:
            diff = (ours[k].double() - ddp[k].double()).abs().max().item()
            assert diff <= 1e-6, f"rank {rank}: {k} differs from DDP by {diff}"


def unreachable() -> str:
    import dear
    try:
        dear.init()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_an_unusable_interface_fails_clearly_on_every_rank(tmp_path, monkeypatch) -> None:
    script = tmp_path / "bad.py"
    script.write_text("import torch, horovod.torch as hvd\n"
                      "from tests.test_horovod_data_plane import unreachable\n"
                      "hvd.init()\nr = unreachable()\n"
                      f"torch.save(r, {str(tmp_path)!r} + f'/{{hvd.rank()}}.pt')\n")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    run_horovod([str(script)], np=2, timeout=60)
    for rank in range(2):
        message = torch.load(tmp_path / f"{rank}.pt")
        assert "Gloo data plane did not start" in message, message
        assert "'nosuchif0'" in message and "does not exist" in message, message
        assert "DEAR_HOROVOD_DATA_PLANE=horovod" in message, message


if __name__ == "__main__":
    sys.exit("run with pytest")
