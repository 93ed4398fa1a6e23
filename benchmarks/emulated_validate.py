"""dear.diagnose's simulator against the emulated accelerator, in one run per setup.

    python -m benchmarks.emulated_validate --setups resnet50:2,resnet50:4,resnet50:8 \
        --compute-ms 860 --rounds 1 --name emulated_validate

Why: the emulated accelerator (benchmarks/emulated.py) sleeps its compute, so the cores are
free and there is no contention to model: the replay should predict every method. Each setup
runs once on the emulated cluster (benchmarks.emulated_bench's machinery: the same worker,
link measurement, compute-only run and interleaved rounds of methods), and before the rounds
every rank (a) traces dear in DeAR's order with dear.diagnose (the tracer pauses the planned
schedule; the simulator replays the planned schedule from this trace) and (b) probes torch's
Gloo all-reduce at a few sizes (the trace holds only dear's reduce-scatters and all-gathers;
DDP, WFBP and Horovod all-reduce). The driver then predicts each method from the trace:
DDP, WFBP (25 MB buckets), Horovod (dynamic fusion, dear/diagnose/dynamic.py; a fused response
at Horovod's own probed cost, a lone tensor at torch's), DeAR's order and the planned schedule,
and writes predicted vs measured. FSDP2 is not modelled by the simulator.

Scaling: from the first 2-rank setup's trace, samples/s for 1..64 workers (alpha-beta ring
costs), against the measured points of the other setups at the same compute (--compute-ms is
one value for every setup). A setup with scaled-down parameters (SETUPS: 8 ranks at 1/2 size
and 500 Mbit/s) is compared at the 2-rank trace's full size on a link `scale` times its
measured rate: the same seconds of transfer per byte of the real model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from benchmarks import emulated, emulated_bench, emulated_report, methods, results

METHODS = "ddp,wfbp,horovod,dear:schedule=dear,dear"
SCHEDULES = {"ddp": "ddp", "wfbp": "wfbp", "horovod": "horovod", "dear:schedule=dear": "dear",
             "dear": "planned", "dear:row_sparse=tables": "planned"}
PROBE_MB = (1, 8, 32)
WORKERS = (1, 2, 4, 8, 16, 32, 64)
TOLERANCE = 0.05


# ---------------------------------------------------------------- every rank, before the rounds


def _extend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--trace-warmup", type=int, default=3)
    p.add_argument("--trace-iters", type=int, default=6)
    p.add_argument("--allreduce-cost", choices=("probe", "trace"), default="probe",
                   help="DDP/WFBP's all-reduce: the probe of torch's all_reduce, or the trace's "
                   "reduce-scatter + all-gather (ring identity)")
    p.add_argument("--reuse", default="", help="recompute the predictions from these earlier "
                   "results JSONs (comma-separated; their traces must still exist), measuring "
                   "nothing")


def trace_and_probe(args: argparse.Namespace, model_spec: emulated.ModelSpec) -> dict[str, Any]:
    """A dear.diagnose trace of dear in DeAR's order (args.trace_dir) and torch's all-reduce
    timed at PROBE_MB sizes (median of 5, slowest rank)."""
    import dear.diagnose
    from benchmarks.methods import Built, parse_method

    rank = dist.get_rank()
    model = emulated.EmulatedModel(model_spec)
    built = Built(parse_method("dear:schedule=dear"), model, emulated_bench.make_optimizer("probe"))
    opt = built.opt
    w, k = args.trace_warmup, args.trace_iters
    with dear.diagnose.trace(model, opt, out=args.trace_dir, iterations=range(w, w + k)):
        for step in range(w + k + 1):
            x, y = emulated.make_batch(step, rank, args.batch)
            opt.zero_grad()
            emulated.loss_fn(model(x), y).backward()
            opt.step()
    del opt, model
    built.finish()
    probe = {}
    for mb in PROBE_MB:                        # allocated outside the timing
        buf = torch.ones(mb * 2**18)
        probe[mb * 2**20] = _timed(lambda: dist.all_reduce(buf))
    out = {"trace_dir": args.trace_dir, "allreduce_probe_s": probe,
           "wfbp_unpack_s": _timed(_unpack_probe(model_spec))}
    if "horovod" in [m.base for m in methods.parse_methods(args.methods)]:
        _probe_in_first_round(args, model_spec, out)
    return out


def _timed(fn: Any, repeats: int = 5) -> float:
    """Median seconds of fn() after one warm-up, the slowest rank's. 5 repeats: with 3, a 1 MB
    probe at 8 ranks on 2 cores once came out 4x slower than in the runs before and after."""
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times[1:])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _unpack_probe(model_spec: emulated.ModelSpec) -> Any:
    """What benchmarks.baselines.WFBP.step() does after its waits, on local data: average each
    bucket buffer in place and clone every parameter's gradient out of it (fresh memory each
    step, as there)."""
    from dear.fusion.planner import plan_buckets
    shapes = [torch.Size(s) for layer in model_spec.layers for _, s in layer.params]
    metas = [torch.empty(s, device="meta") for s in shapes]
    specs = plan_buckets(metas, list(reversed(range(len(metas)))), 25 * 2**20, 1)
    buffers = [torch.ones(s.padded_numel) for s in specs]

    def unpack() -> None:
        grads = []
        for spec, buf in zip(specs, buffers):
            buf.div_(2)
            for j, i in enumerate(spec.params):
                grads.append(buf[spec.offsets[j]:spec.offsets[j] + spec.numels[j]]
                             .view(shapes[i]).clone())
    return unpack


def _forward_s(args: argparse.Namespace, model_spec: emulated.ModelSpec) -> float:
    """The emulated model's forward alone (no communication): median of 3 after 1, slowest
    rank."""
    dist.barrier()
    run = emulated_bench.compute_only(model_spec, 1, 3, args.batch)
    t = torch.tensor([statistics.median(run["times"]["forward"])])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _probe_in_first_round(args: argparse.Namespace, model_spec: emulated.ModelSpec,
                          out: dict[str, Any]) -> None:
    """Probes Horovod inside the benchmark's own first Horovod round, right after its hvd.init()
    and before that round's iterations, filling `out` (the report's "extra", written after the
    rounds). Why there: no init of its own. One of its own used to make a later init abort at
    8 ranks (Gloo "connection refused": Horovod's rendezvous server kept stale addresses, now
    fixed in benchmarks/cluster.py), which left Horovod unprobed at 8 ranks."""
    build = methods.BUILDERS["horovod"]

    def probing(model: emulated.EmulatedModel, make_opt: Any, opts: dict[str, Any],
                blocks: Any) -> tuple:
        methods.BUILDERS["horovod"] = build                   # once: round 1
        plain = _forward_s(args, model_spec)
        built = build(model, make_opt, opts, blocks)          # hvd.init()
        out["horovod_forward_s"] = {"plain": plain, "horovod": _forward_s(args, model_spec)}
        out["horovod_allreduce_s"] = _horovod_allreduce_s()
        return built
    methods.BUILDERS["horovod"] = probing


def _horovod_allreduce_s() -> dict[int, float]:
    """Horovod's own all-reduce (fusion buffer copies, its Gloo ring, averaging) of 8 tensors
    submitted at once, as its optimizer's hooks do: fused into one response. The forward pass
    is timed beside it without Horovod, then with it initialised and idle: its background
    thread runs a negotiation cycle every 1 ms even with nothing to send, taking CPU from the
    training thread while the link is idle (forward; in backward it blocks in its
    all-reduces)."""
    import horovod.torch as hvd
    out = {}
    for mb in PROBE_MB:
        tensors = [torch.ones(mb * 2**15) for _ in range(8)]

        def run() -> None:
            handles = [hvd.allreduce_async_(t, op=hvd.Average, name=f"probe.{mb}.{i}")
                       for i, t in enumerate(tensors)]
            for h in handles:
                hvd.synchronize(h)
        out[mb * 2**20] = _timed(run)
    return out


def worker(argv: list[str]) -> int:
    args = emulated_bench.parse_args(argv, _extend)
    return emulated_bench.worker(args, lambda spec: trace_and_probe(args, spec))


# ---------------------------------------------------------------- the driver: predictions


def simulator(rep: dict[str, Any], probe: Optional[str] = "allreduce_probe_s",
              trace: Any = None) -> Any:
    """The trace's simulator, without the first traced iteration (its forward waits for
    all-gathers issued before the trace: untraced waits, counted as compute), its all-reduce
    cost from `probe` (alpha-beta, least squares over the probed sizes). `trace`: the setup's
    trace, loaded already."""
    from dear.diagnose import Simulator, load_trace

    trace = load_trace(rep["extra"]["trace_dir"]) if trace is None else trace
    sim = Simulator(trace, iterations=trace.common_iterations()[1:])
    if probe is not None:
        sim.fitted = probed_cost(sim.fitted, rep, probe)
    return sim


def probed_cost(fitted: Any, rep: dict[str, Any], probe: str) -> Any:
    """`fitted` (a CostModel) with its all-reduce from the probe `probe` of the run."""
    from dear.diagnose import CostModel
    from dear.diagnose.costmodel import latency_steps, volume

    n = fitted.world_size
    pts = [(volume("all_reduce", int(b), n), s) for b, s in rep["extra"][probe].items()]
    mx, my = statistics.mean(x for x, _ in pts), statistics.mean(y for _, y in pts)
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    alpha = max(my - slope * mx, 0.0) / latency_steps("all_reduce", n)
    return CostModel({**fitted.alpha, "all_reduce": alpha},
                     {**fitted.rate, "all_reduce": 1 / slope}, n)


def _predict(sims: dict[str, Any], rep: dict[str, Any], label: str, **kw: Any) -> float:
    """One method's predicted seconds: Horovod on its own all-reduce cost, WFBP with its
    measured unpacking in step(), bucket by bucket."""
    schedule = SCHEDULES[label]
    unpack = rep["extra"].get("wfbp_unpack_s", 0.0) if schedule == "wfbp" else 0.0
    extra = horovod_idle_s(rep) if schedule == "horovod" else 0.0
    if schedule == "horovod" and "horovod_fused" in sims:
        kw = {"fused_cost": sims["horovod_fused"], **kw}
    tables = rep.get("methods", {}).get(label, {}).get("row_sparse") or {}
    if tables:                                 # sent by rows: as many as the run sent
        index = {p["name"]: i for i, p in enumerate(sims["params"])}
        kw = {"row_sparse": {index[name]: (int(rows), round(sent))
                             for name, (rows, sent) in tables.items()}, **kw}
    return sims["trace"].predict(schedule, step_overhead_s=extra, unpack_s=unpack,
                                 **kw).iteration_time


def horovod_idle_s(rep: dict[str, Any]) -> float:
    """Seconds Horovod's idle negotiation cycles add to the forward pass (measured: forward
    with Horovod initialised minus without, same run, slowest rank). The forward is on the
    critical path with the link idle (step() waited for every all-reduce), so it is replayed
    as that much more serial compute (step_overhead_s: serial too, same iteration time)."""
    f = rep["extra"].get("horovod_forward_s")
    return max(f["horovod"] - f["plain"], 0.0) if f else 0.0


ALLREDUCE_COST = {"source": "probe"}


def simulators(rep: dict[str, Any]) -> dict[str, Any]:
    from dear.diagnose import load_trace
    trace = load_trace(rep["extra"]["trace_dir"])
    sims = {"trace": simulator(rep, "allreduce_probe_s"
                               if ALLREDUCE_COST["source"] == "probe" else None, trace),
            "params": trace.meta["params"]}
    if "horovod_allreduce_s" in rep["extra"]:
        # A response of several tensors at Horovod's own probe (8 tensors fused: its fusion
        # buffer copies); a tensor alone is reduced in place, at torch's all-reduce cost.
        sims["horovod_fused"] = probed_cost(sims["trace"].fitted, rep, "horovod_allreduce_s")
    return sims


def predict_setup(rep: dict[str, Any]) -> list[dict[str, Any]]:
    sims = simulators(rep)
    rows = []
    for label, res in rep["methods"].items():
        schedule = SCHEDULES.get(label)
        if schedule is None:
            continue
        pred = _predict(sims, rep, label)
        rows.append({"setup": rep["setup"], "ranks": rep["ranks"], "method": label,
                     "schedule": schedule, "measured_s": res["median_s"],
                     "q1_s": res["q1_s"], "q3_s": res["q3_s"], "predicted_s": pred,
                     "error": pred / res["median_s"] - 1})
    return rows


def drift(rep: dict[str, Any]) -> dict[str, float]:
    """How the machine moved between the trace and the timed rounds: the traced iterations'
    own wall time (dear in DeAR's order, slowest rank, median of those replayed) against the
    timed rounds' DeAR order, and the traced compute against the compute-only rounds."""
    from dear.diagnose import load_trace
    trace = load_trace(rep["extra"]["trace_dir"])
    its = trace.common_iterations()[1:]
    traced = statistics.median(max(r.iterations[i].end - r.iterations[i].start
                                   for r in trace.ranks) for i in its)
    sim = simulator(rep, None)
    compute = statistics.median(max(p.compute for p in ps) for ps in sim.model.iterations)
    out = {"traced_iteration_s": traced, "traced_compute_s": compute,
           "compute_only_s": rep["t_compute_s"]}
    timed = rep["methods"].get("dear:schedule=dear")
    if timed:
        out["timed_dear_order_s"] = timed["median_s"]
        out["drift"] = timed["median_s"] / traced - 1
    return out


def scaling(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """From the first 2-rank setup's trace: samples/s vs workers per method, and the
    prediction at each measured setup's equivalent link (full size, rate x scale)."""
    base = next((r for r in reps if r["ranks"] == 2), None)
    if base is None:
        return {}
    sims = simulators(base)
    link0 = base.get("bandwidth_measured_bps")
    batch = base["batch_per_rank"]
    curves = {label: [batch * n / _predict(sims, base, label, world_size=n) for n in WORKERS]
              for label in SCHEDULES if label in base["methods"]}
    points = []
    for rep in reps:
        if rep["model"] != base["model"]:      # the curve is the 2-rank trace's model's
            continue
        link = rep.get("bandwidth_measured_bps")
        kw = ({"bandwidth_bps": link * rep["scale"] / base["scale"],
               "traced_bandwidth_bps": link0} if link and link0 else {})
        for label, res in rep["methods"].items():
            if label in SCHEDULES:
                pred = _predict(sims, base, label, world_size=rep["ranks"], **kw)
                points.append({"setup": rep["setup"], "ranks": rep["ranks"], "method": label,
                               "scale": rep["scale"], "measured_samples_s":
                               batch * rep["ranks"] / res["median_s"],
                               "predicted_samples_s": batch * rep["ranks"] / pred,
                               "error": res["median_s"] / pred - 1})
    return {"workers": list(WORKERS), "curves": curves, "points": points,
            "trace_setup": base["setup"]}


def plot_scaling(scale: dict[str, Any], path: str) -> None:
    plt = results.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = dict(zip(SCHEDULES, ("tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:red",
                                  "tab:purple")))
    for label, ys in scale["curves"].items():
        ax.plot(scale["workers"], ys, "-", color=colors[label], label=f"{label} (predicted)")
        pts = [p for p in scale["points"] if p["method"] == label]
        ax.plot([p["ranks"] for p in pts], [p["measured_samples_s"] for p in pts], "o",
                color=colors[label], markersize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("workers")
    ax.set_ylabel("samples/s")
    ax.set_title(f"predicted from the {scale['trace_setup']} trace (lines), measured (dots)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker(argv)
    args = emulated_bench.parse_args(argv, _extend)
    ALLREDUCE_COST["source"] = args.allreduce_cost
    if args.methods == emulated_bench.DEFAULT_METHODS:
        args.methods = METHODS
    if not args.compute_ms:
        raise SystemExit("give --compute-ms: one compute time for every setup, so the scaling "
                         "points are comparable")
    from benchmarks.cluster import check_can_shape
    shaping = not args.no_shaping
    if shaping and (why := check_can_shape()):
        print(f"emulated_validate: {why}; running on loopback (unshaped)", file=sys.stderr)
        shaping = False
    if args.reuse:                            # one or more results JSONs, comma-separated
        olds = []
        for path in args.reuse.split(","):
            with open(path) as fh:
                olds.append(json.load(fh))
        # A setup measured again in a later file replaces the earlier one.
        latest = {rep["setup"]: rep for old in olds for rep in old["reports"]}
        reps = list(latest.values())
        rows = [r for rep in reps for r in predict_setup(rep)]
        measured = [f"`{old['command']}` ({old['date']})" for old in olds if "command" in old]
        write(args, reps, rows, scaling(reps), olds[0]["shaping"],
              ", ".join(sorted({os.path.dirname(rep["extra"]["trace_dir"]) for rep in reps})),
              measured)
        return 0
    # dear.diagnose replays dense buckets (a traced window sends embedding tables whole), so
    # the dear methods measured against it send them whole too.
    os.environ["DEAR_ROW_SPARSE"] = "off"
    workdir = tempfile.mkdtemp(prefix="dear-emulated-validate-")
    reps, rows = [], []
    for i, setup in enumerate(s for s in args.setups.split(",") if s.strip()):
        trace_dir = os.path.join(workdir, f"setup{i}")
        try:
            rep = emulated_bench.run_setup(
                setup, args, shaping, module="benchmarks.emulated_validate",
                worker_args=("--trace-dir", trace_dir, "--trace-warmup", str(args.trace_warmup),
                             "--trace-iters", str(args.trace_iters)))
        except SystemExit as exc:             # keep the setups already measured
            print(f"emulated_validate: {setup} skipped: {exc}", file=sys.stderr, flush=True)
            continue
        reps.append(rep)
        rows += predict_setup(rep)
        for r in rows[-len(rep["methods"]):]:
            print(f"{r['setup']} {r['method']}: measured {r['measured_s'] * 1e3:.0f} ms, "
                  f"predicted {r['predicted_s'] * 1e3:.0f} ms ({r['error']:+.1%})", flush=True)
    scale = scaling(reps)
    write(args, reps, rows, scale, shaping, workdir)
    return 0


def write(args: argparse.Namespace, reps: list[dict[str, Any]], rows: list[dict[str, Any]],
          scale: dict[str, Any], shaping: bool, workdir: str,
          measured: Optional[list[str]] = None) -> None:
    table = results.markdown_table(
        ["setup", "method", "schedule", "measured (ms)", "IQR (ms)", "predicted (ms)", "error",
         "within 5%"],
        [[r["setup"], r["method"], r["schedule"], round(r["measured_s"] * 1e3),
          f"{r['q1_s'] * 1e3:.0f}-{r['q3_s'] * 1e3:.0f}", round(r["predicted_s"] * 1e3),
          f"{r['error']:+.1%}", "yes" if abs(r["error"]) <= TOLERANCE else "NO"] for r in rows])
    notes = [emulated_report.table(reps)[1]]
    if measured:
        notes.insert(0, "Predictions recomputed (--reuse) from the runs measured by: "
                     + "; ".join(measured))
    drifts = [(rep["setup"], drift(rep)) for rep in reps]
    notes.append("Trace vs timed rounds (the same method, dear in DeAR's order: a difference is "
                 "the machine, not the replay; compute: the trace's per-iteration compute, "
                 "slowest rank, vs the compute-only rounds, which lack dear's own CPU work):")
    notes.append(results.markdown_table(
        ["setup", "traced iteration (ms)", "timed DeAR order (ms)", "timed / traced",
         "traced compute (ms)", "compute-only (ms)", "Horovod idle-cycle forward (ms)"],
        [[setup, round(d["traced_iteration_s"] * 1e3),
          round(d["timed_dear_order_s"] * 1e3) if "drift" in d else "-",
          f"{d['drift']:+.1%}" if "drift" in d else "-", round(d["traced_compute_s"] * 1e3),
          round(d["compute_only_s"] * 1e3),
          round(horovod_idle_s(rep) * 1e3) if "horovod_forward_s" in rep["extra"] else "-"]
         for (setup, d), rep in zip(drifts, reps)]))
    if scale:
        png = os.path.join(results.RESULTS_DIR, f"{args.name}_scaling.png")
        plot_scaling(scale, png)
        notes.append("Scaling, predicted from the " + scale["trace_setup"] + " trace (samples/s; "
                     "scaled setups compared at full size on a link scale x their measured rate):")
        notes.append(results.markdown_table(
            ["setup", "method", "measured samples/s", "predicted samples/s", "error"],
            [[p["setup"], p["method"], round(p["measured_samples_s"], 1),
              round(p["predicted_samples_s"], 1), f"{p['error']:+.1%}"]
             for p in scale["points"]]))
        notes.append(results.markdown_table(
            ["method"] + [str(n) for n in scale["workers"]],
            [[m] + [round(y, 1) for y in ys] for m, ys in scale["curves"].items()]))
        notes.append(f"![scaling]({os.path.basename(png)})")
    notes.append(f"DDP/WFBP all-reduce cost: {ALLREDUCE_COST['source']} (probe: torch's Gloo "
                 "all_reduce timed at " + "/".join(map(str, PROBE_MB)) + " MB in the run; trace: "
                 "the traced reduce-scatter + all-gather, ring identity). Horovod: a response of "
                 "several tensors at its own all-reduce probed the same way (8 tensors fused: "
                 "its fusion buffer copies), a tensor alone at torch's (reduced in place), + "
                 "the forward's slowdown while Horovod is "
                 "initialised and idle (its 1 ms negotiation cycle takes CPU). Both probed in "
                 "the first Horovod round, right after its own hvd.init(). WFBP: + its measured "
                 "step() unpacking, each "
                 "bucket's share right after its wait (while later all-reduces travel). DDP "
                 "and WFBP: two all-reduces at a time share the link (torch's Gloo process "
                 "group runs two at once: benchmarks/results/gloo_concurrency.md). The "
                 "first traced iteration is left out (its forward waits for untraced "
                 f"all-gathers). Load average (1 min) now {os.getloadavg()[0]:.2f}; traces "
                 f"kept in {workdir}.")
    print(table)
    print("\n\n".join(notes))
    results.write(args.name, "dear.diagnose's simulator vs the emulated accelerator",
                  {"shaping": shaping, "rows": rows, "scaling": scale, "reports": reps},
                  table, "\n\n".join(notes))


if __name__ == "__main__":
    sys.exit(main())
