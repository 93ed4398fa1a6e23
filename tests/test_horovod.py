"""The one-line swap from hvd.DistributedOptimizer to dear.DistributedOptimizer, under Horovod.

These tests FAIL (never skip) when Horovod is missing: `make test` builds it, and CI must prove
that it did. Results are bit-identical to Horovod's on every rank, fp16 compression included."""

import os

import torch

from tests.horovod_launch import horovod_available, run_horovod
from tests.subprocesses import BIN, ROOT, run
from tests.workloads import set_batch, set_net, set_reference


def test_horovod_is_installed_with_its_torch_extension():
    assert horovod_available(), "Horovod with its torch extension is missing: run `make horovod`"


def _compare(path: str, world: int = 2) -> None:
    """Every rank's parameters after training with dear equal, bit for bit, that rank's with
    hvd.DistributedOptimizer."""
    for rank in range(world):
        results = torch.load(path + (f".{rank}" if rank else ""))
        assert results
        for key, res in results.items():
            for name, ref in res["horovod"].items():
                diff = (res["dear"][name] - ref).abs().max().item()
                assert torch.equal(res["dear"][name], ref), \
                    f"rank {rank}, {key}: {name} differs from Horovod by {diff}"


def test_one_line_swap_matches_horovod(tmp_path):
    """dear's default Horovod data plane: the pairwise exchange on private Gloo groups."""
    out = str(tmp_path / "matrix.pt")
    run_horovod(["-m", "tests.hvd_matrix", out], np=2, timeout=240)
    assert len(torch.load(out)) == 9      # sgd/adam x none/fp16 x 1/2 passes, + clipping loop
    _compare(out)


def test_one_line_swap_on_horovods_own_collectives(tmp_path, monkeypatch):
    out = str(tmp_path / "matrix.pt")
    monkeypatch.setenv("DEAR_HOROVOD_DATA_PLANE", "horovod")
    run_horovod(["-m", "tests.hvd_matrix", out, "sgd-fp16-1,adam-none-2,clip"], np=2,
                timeout=180)
    assert sorted(torch.load(out)) == ["adam-none-2", "clip", "sgd-fp16-1"]
    _compare(out)


def test_under_horovodrun(tmp_path):
    out = str(tmp_path / "matrix.pt")
    res = run([os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
               os.path.join(BIN, "python"), "-m", "tests.hvd_matrix", out,
               "sgd-none-1,adam-fp16-2,clip"], timeout=180, env={"PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stdout
    assert sorted(torch.load(out)) == ["adam-fp16-2", "clip", "sgd-none-1"]
    _compare(out)


def horovod_backend_errors() -> dict:
    import horovod.torch as hvd
    import dear
    hvd.init()
    dear.init()                                # auto: Horovod under a Horovod launcher
    errors = {}
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    try:                                       # refused when wrapping, not mid-training
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    except TypeError as exc:
        errors["bf16"] = str(exc)
    try:
        dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    except ValueError as exc:
        errors["adasum"] = str(exc)
    return errors


def test_bfloat16_and_adasum_are_refused_clearly(tmp_path, monkeypatch):
    """On Horovod's own data plane; the Gloo plane carries bfloat16 (test_horovod_data_plane)."""
    script = tmp_path / "errors.py"
    out = tmp_path / "errors.pt"
    script.write_text("import sys, torch\nfrom tests.test_horovod import horovod_backend_errors\n"
                      "e = horovod_backend_errors()\nimport horovod.torch as hvd\n"
                      f"torch.save(e, {str(out)!r}) if hvd.rank() == 0 else None\n")
    monkeypatch.setenv("DEAR_HOROVOD_DATA_PLANE", "horovod")
    run_horovod([str(script)], np=2, timeout=120)
    errors = torch.load(out)
    assert "does not support torch.bfloat16" in errors["bf16"]
    assert "DEAR_HOROVOD_DATA_PLANE=gloo" in errors["bf16"]
    assert "Adasum is not supported" in errors["adasum"]


def concurrent_collectives() -> dict:
    """Several large reduce-scatters and all-gathers in flight at once (Horovod's own
    reducescatter returns garbage on rank 0 here; dear's backend must not)."""
    import dear
    from dear.comm.runtime import communicator
    dear.init()
    comm, n = communicator(), dear.size()
    sizes = [6_000_000, 5_000_000, 14_000_006, 2002]
    ins = [torch.randn(s, generator=torch.Generator().manual_seed(comm.rank * 10 + i))
           for i, s in enumerate(sizes)]
    refs = [sum(torch.randn(s, generator=torch.Generator().manual_seed(q * 10 + i))
                for q in range(n)) for i, s in enumerate(sizes)]
    shards = [torch.empty(s // n) for s in sizes]
    works = [comm.reduce_scatter(x, o) for x, o in zip(ins, shards)]
    for w in works:
        w.wait()
    gathered = [torch.empty(s) for s in sizes]
    works = [comm.all_gather(o, g) for o, g in zip(shards, gathered)]
    for w in works:
        w.wait()
    return {"name": comm.name,
            "rs": max((o - ref.view(n, -1)[comm.rank]).abs().max().item()
                      for o, ref in zip(shards, refs)),
            "ag": max((g - ref).abs().max().item() for g, ref in zip(gathered, refs))}


def test_concurrent_large_collectives_on_horovod(tmp_path):
    """On both data planes (Horovod's own: the alltoall workaround), one launch."""
    script = tmp_path / "conc.py"
    script.write_text("import os, torch\nfrom tests.test_horovod import concurrent_collectives\n"
                      "import dear, horovod.torch as hvd\nhvd.init()\n"
                      "for plane in ('gloo', 'horovod'):\n"
                      "    os.environ['DEAR_HOROVOD_DATA_PLANE'] = plane\n"
                      "    e = concurrent_collectives()\n"
                      f"    torch.save(e, {str(tmp_path)!r} + f'/{{plane}}{{dear.rank()}}.pt')\n"
                      "    dear.shutdown()\n")
    run_horovod([str(script)], np=2, timeout=120)
    for plane, name in (("gloo", "horovod-gloo-pairwise"), ("horovod", "horovod")):
        for r in range(2):
            errors = torch.load(tmp_path / f"{plane}{r}.pt")
            assert errors["name"] == name
            assert errors["rs"] < 1e-5 and errors["ag"] < 1e-5, (plane, errors)


def process_set_training(out: str) -> None:
    """3 ranks; the optimizer averages over Horovod's process set {0, 2} on every rank (rank 1
    is outside it and trains alone, as under Horovod). Each rank saves its parameters and the
    names Horovod's tests read (`_parameter_names`)."""
    import horovod.torch as hvd

    import dear
    hvd.init()
    pair = hvd.add_process_set([0, 2])
    model = set_net()
    torch.manual_seed(0)
    for p in model.parameters():
        torch.nn.init.normal_(p)
    opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    named_parameters=model.named_parameters(),
                                    process_set=pair)
    for step in range(4):
        x, y = set_batch(step, hvd.rank())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    names = sorted(opt._parameter_names.values())
    torch.save({"state": state, "names": names}, f"{out}.{hvd.rank()}")
    dear.shutdown()
    hvd.remove_process_set(pair)


def test_a_process_set_averages_over_its_own_ranks(tmp_path, monkeypatch):
    """Horovod's process_set= for a subset of ranks: the ranks of the set train as one process
    on their concatenated batches; a rank outside it trains on its own batch (Horovod's
    optimizer averages nothing there)."""
    out = str(tmp_path / "ps")
    script = tmp_path / "ps.py"
    script.write_text("import sys\nfrom tests.test_horovod import process_set_training\n"
                      f"process_set_training({out!r})\n")
    monkeypatch.setenv("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    run_horovod([str(script)], np=3, timeout=180)

    def reference(ranks: list[int]) -> dict:
        model = set_net()
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p)
        return set_reference(model.state_dict(), ranks)

    results = [torch.load(f"{out}.{r}") for r in range(3)]
    for ranks, members in (([0, 2], (0, 2)), ([1], (1,))):
        ref = reference(ranks)
        for r in members:
            for name, value in ref.items():
                # the set's average: sums of two halves instead of one batch (float32 rounding)
                torch.testing.assert_close(results[r]["state"][name], value, rtol=1e-5,
                                           atol=1e-6, msg=f"rank {r}, {name}")
    assert results[0]["names"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
