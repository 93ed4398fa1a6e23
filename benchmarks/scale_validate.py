"""The throughput-vs-workers curve (dear.diagnose.scale) against runs on the emulated cluster.

    python -m benchmarks.scale_validate --models resnet50,bert_base --links 1gbit,2gbit \
        --ranks 2,3,4,6,8 --compute resnet50=600,bert_base=1200 --name scale_validation

Per model and link rate L: 2 ranks run on the emulated cluster (benchmarks.emulated_validate's
worker: a dear.diagnose trace in DeAR's order, torch's all-reduce probed, then the methods
timed); 3, 4, 6 and 8 ranks run the methods only (benchmarks.emulated_bench's worker). From the
2-rank run alone, each larger run's samples/s is predicted three ways:
- replay: dear.diagnose.scaling_curve on the 2-rank trace (all-reduce cost from the probe, as
  emulated_validate), at the larger run's measured link rate (each collective keeping the
  efficiency it had on the traced link) and, for a run with scaled-down parameters, the
  scaled model's parameter sizes (what ran; its buckets follow);
- queueing: the closed form of dear.diagnose.queueing, same inputs;
- Pollux: its throughput model fitted as Pollux fits it (dear.diagnose.pollux) to the two
  points the 2-rank run gives: 1 worker (the compute-only rounds) and 2 workers (the method's
  measured time), each worker its own node (every rank has its own shaped link).
Scaled parameters (benchmarks/emulated.py `scale`): a run of N ranks at rate L/s with every
parameter 1/s the size is the full model at rate L (same seconds of transfer per byte), so 8
ranks fit on 2 cores: s is the smallest power of two keeping N x L / s <= --max-total (2 Gbit/s:
at 4 Gbit/s through the switch, 6-8 ranks slowed the emulated compute itself by 40-75% on
this 2-core machine).
Error = predicted samples/s / measured - 1.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import tempfile
from typing import Any, Optional

from benchmarks import emulated, emulated_bench, emulated_validate, results

TOLERANCE = 0.05
METHODS = "ddp,dear"
SCHEDULES = {"ddp": "ddp", "dear": "planned", "dear:schedule=dear": "dear", "wfbp": "wfbp"}


def _rate(text: str) -> float:
    from dear.diagnose.simulate_cli import _rate as parse
    return parse(text)


def _extend(p: argparse.ArgumentParser) -> None:
    emulated_validate._extend(p)
    p.add_argument("--models", default="resnet50,bert_base")
    p.add_argument("--links", default="1gbit,2gbit", help="full-size link rates")
    p.add_argument("--ranks", default="2,3,4,6,8", help="2 (the traced run) and the others")
    p.add_argument("--compute", default="resnet50=600,bert_base=1200",
                   help="MODEL=MS: compute per iteration on the emulated accelerator")
    p.add_argument("--only", default="",
                   help="run exactly these setups MODEL:N:RATE:SCALE,... (a rerun; combine "
                        "with the first run's JSON by --reuse FIRST,SECOND)")
    p.add_argument("--exclude", default="",
                   help="setups left out of the main table (listed apart), e.g. runs the "
                        "machine's load spoiled; a traced one is then not the group's trace")
    p.add_argument("--exclude-why", default="", help="why, for the notes")
    p.add_argument("--max-total", default="2gbit",
                   help="most traffic through the emulated switch (ranks x link rate)")
    p.add_argument("--trace-each-scale", action="store_true",
                   help="trace 2 ranks at every parameter scale the group's runs use (on a "
                        "link slowed to match) and predict each run from the trace at its own "
                        "scale; without it, one trace per group, its parameters rescaled")


def plan(model: str, link: str, ranks: list[int], max_total: float,
         trace_each_scale: bool = False) -> list[tuple[int, str]]:
    """Setups MODEL:N:RATE:SCALE for each N, scaled to fit the switch; with
    `trace_each_scale`, one more 2-rank (traced) setup for each scale the others run at."""
    sized = []
    for n in ranks:
        scale = 1
        while n * _rate(link) / scale > max_total * (1 + 1e-9):
            scale *= 2
        sized.append((n, scale))
    if trace_each_scale:                     # right after the group's own 2-rank run
        at = next(i for i, (n, _) in enumerate(sized) if n == 2) + 1
        traced = {k for n, k in sized if n == 2}
        sized[at:at] = [(2, k) for k in dict.fromkeys(k for _, k in sized) if k not in traced]
    return [(n, f"{model}:{n}:{_rate(link) / k / 1e6:g}mbit:{k}") for n, k in sized]


def scaled_simulator(sim: Any, model: str, traced_scale: int, scale: int) -> Any:
    """The 2-rank trace's simulator (parameters at 1/traced_scale size) with the parameters
    of `model` at 1/scale size (the emulated model registers them in its spec's order);
    buckets re-planned."""
    from dear.diagnose import Simulator
    if scale == traced_scale:
        return sim
    traced, small = emulated.spec(model, traced_scale), emulated.spec(model, scale)
    shapes = [s for layer in traced.layers for _, s in layer.params]
    m = sim.model
    if [int(_prod(s)) for s in shapes] != m.param_numel:
        raise SystemExit(f"{model}: the traced parameters are not the emulated spec's")
    numel = [int(_prod(s)) for layer in small.layers for _, s in layer.params]
    width = [b // max(n, 1) for b, n in zip(m.param_bytes, m.param_numel)]
    scaled = dataclasses.replace(m, param_numel=numel,
                                 param_bytes=[n * w for n, w in zip(numel, width)],
                                 buckets=[], gather_groups=[])
    out = copy.copy(sim)
    out.model = scaled
    assert isinstance(out, Simulator)
    return out


def _prod(shape: Any) -> int:
    k = 1
    for d in shape:
        k *= int(d)
    return k


def predict_group(trace_rep: dict[str, Any], reps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every run of one (model, link) predicted from its 2-rank run."""
    from dear.diagnose import Topology, scaling_curve
    from dear.diagnose.pollux import Observation, fit_pollux
    sims = emulated_validate.simulators(trace_rep)
    link0 = trace_rep.get("bandwidth_measured_bps") or None
    batch = trace_rep["batch_per_rank"]
    t1 = trace_rep["t_compute_s"]
    rows = []
    for rep in sorted(reps, key=lambda r: r["ranks"]):
        n = rep["ranks"]
        sim = scaled_simulator(sims["trace"], rep["model"], trace_rep["scale"], rep["scale"])
        link = rep.get("bandwidth_measured_bps") or None
        topo = Topology(bandwidth_bps=link if link0 else None,
                        traced_bandwidth_bps=link0 if link else None)
        for label, res in rep["methods"].items():
            schedule = SCHEDULES.get(label)
            if schedule is None or label not in trace_rep["methods"]:
                continue
            curve = scaling_curve(sim, [n], [schedule], topology=topo, batch_size=batch)
            # The same with the compute as this run's compute-only rounds measured it: on 2
            # cores, 6-8 ranks' Python and Gloo threads slow the emulated compute itself
            slowed = scaling_curve(sim, [n], [schedule], topology=topo, batch_size=batch,
                                   models=("replay",),
                                   compute_scale=rep["t_compute_s"] / t1)
            t2 = trace_rep["methods"][label]["median_s"]
            pollux = fit_pollux([Observation(1, 1, t1, t1), Observation(2, 2, t2, t1)])
            measured = batch * n / res["median_s"]
            row = {"model": rep["model"], "link": rep["link"], "setup": rep["setup"],
                   "ranks": n, "scale": rep["scale"], "method": label, "schedule": schedule,
                   "measured_s": res["median_s"], "q1_s": res["q1_s"], "q3_s": res["q3_s"],
                   "measured_samples_s": measured, "traced": n == trace_rep["ranks"],
                   "pollux_params": dataclasses.asdict(pollux),
                   "cost_s": curve.cost_s,
                   "switch_bps": n * (rep.get("bandwidth_measured_bps") or 0.0)}
            for name, pred_s in (("replay", curve.seconds["replay"][schedule][0]),
                                 ("queueing", curve.seconds["queueing"][schedule][0]),
                                 ("pollux", pollux.step_s(n, n)),
                                 ("replay_cpu", slowed.seconds["replay"][schedule][0])):
                row[f"{name}_s"] = pred_s
                row[f"{name}_samples_s"] = batch * n / pred_s
                row[f"{name}_error"] = (batch * n / pred_s) / measured - 1
            rows.append(row)
    return rows


def run(args: argparse.Namespace, shaping: bool) -> list[dict[str, Any]]:
    """Every setup, in (model, link) groups, the 2-rank run first; partial results are
    written after each group."""
    # dear.diagnose replays dense buckets, and dear plans after 2 iterations (not 4): fewer
    # warm-up iterations at 8 ranks on 2 cores; once planned, the same schedule.
    os.environ["DEAR_ROW_SPARSE"] = "off"
    os.environ.setdefault("DEAR_PLAN_AFTER", "2")
    workdir = tempfile.mkdtemp(prefix="dear-scale-validate-")
    compute = dict(item.split("=") for item in args.compute.split(","))
    ranks = [int(r) for r in args.ranks.split(",")]
    if 2 not in ranks:
        raise SystemExit("--ranks must include 2: the traced run")
    reps: list[dict[str, Any]] = []
    todo = [(model, link, plan(model, link, sorted(ranks), _rate(args.max_total),
                               args.trace_each_scale))
            for model in args.models.split(",") for link in args.links.split(",")]
    if args.only:
        todo = []
        for setup in args.only.split(","):
            model, n, bw, scale = setup.split(":")
            link = f"{_rate(bw) * int(scale) / 1e9:g}gbit"
            todo.append((model, link, [(int(n), setup)]))
    for model, link, setups in todo:
        margs = copy.copy(args)
        margs.compute_ms = float(compute[model])
        for n, setup in setups:
            trace_dir = os.path.join(workdir, setup.replace(":", "-"))
            traced = n == 2
            try:
                rep = emulated_bench.run_setup(
                    setup, margs, shaping,
                    module="benchmarks.emulated_validate" if traced
                    else "benchmarks.emulated_bench",
                    worker_args=("--trace-dir", trace_dir, "--trace-warmup",
                                 str(args.trace_warmup), "--trace-iters",
                                 str(args.trace_iters)) if traced else ())
            except SystemExit as exc:
                print(f"scale_validate: {setup} skipped: {exc}", file=sys.stderr,
                      flush=True)
                continue
            rep["link"] = link
            reps.append(rep)
            print(f"scale_validate: {setup}: " + ", ".join(
                f"{k} {v['median_s'] * 1e3:.0f} ms" for k, v in rep["methods"].items()),
                file=sys.stderr, flush=True)
            with open(os.path.join(workdir, "reports.json"), "w") as fh:
                json.dump({"reports": reps, "shaping": shaping,
                           "command": results.command(), "date": "(partial)"}, fh,
                          default=str)
        try:
            write(args, reps, shaping, workdir)
        except Exception:                   # keep measuring: --reuse redoes predictions
            import traceback
            traceback.print_exc()
    return reps


def groups(reps: list[dict[str, Any]], excluded: frozenset = frozenset()
           ) -> list[dict[str, Any]]:
    """Each (model, link)'s runs predicted from a traced 2-rank run not `excluded`: the one
    at the run's own parameter scale where there is one (--trace-each-scale), else the
    group's first."""
    rows = []
    for key in dict.fromkeys((r["model"], r["link"]) for r in reps):
        mine = [r for r in reps if (r["model"], r["link"]) == key]
        traces: dict[int, dict[str, Any]] = {}
        for r in mine:
            if r["ranks"] == 2 and "extra" in r and r["setup"] not in excluded:
                traces.setdefault(r["scale"], r)
        if not traces:
            continue
        first = next(iter(traces.values()))
        for base in traces.values():
            runs = [r for r in mine if traces.get(r["scale"], first) is base]
            rows += predict_group(base, runs)
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    plt = results.pyplot()
    keys = list(dict.fromkeys((r["model"], r["link"]) for r in rows))
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4.5 * max(len(keys), 1), 4),
                             squeeze=False)
    colors = {"ddp": "tab:gray", "dear": "tab:red", "dear:schedule=dear": "tab:orange",
              "wfbp": "tab:blue"}
    for ax, key in zip(axes.flat, keys):
        mine = [r for r in rows if (r["model"], r["link"]) == key]
        for method in dict.fromkeys(r["method"] for r in mine):
            pts = sorted((r for r in mine if r["method"] == method), key=lambda r: r["ranks"])
            ns = [r["ranks"] for r in pts]
            c = colors.get(method, "tab:green")
            ax.plot(ns, [r["measured_samples_s"] for r in pts], "o", color=c, markersize=7,
                    label=f"{method} measured")
            ax.plot(ns, [r["replay_samples_s"] for r in pts], "-", color=c, label="replay")
            ax.plot(ns, [r["queueing_samples_s"] for r in pts], "--", color=c,
                    label="queueing")
            ax.plot(ns, [r["pollux_samples_s"] for r in pts], ":", color=c, label="Pollux")
        ax.set_title(f"{key[0]}, {key[1]} (full-size equivalent)", fontsize=9)
        ax.set_xlabel("workers")
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(args: argparse.Namespace, reps: list[dict[str, Any]], shaping: bool, workdir: str,
          measured: Optional[str] = None) -> None:
    excluded = frozenset(filter(None, args.exclude.split(",")))
    every = groups(reps, excluded)
    rows = [r for r in every if r["setup"] not in excluded]
    pct = lambda x: f"{x:+.1%}"  # noqa: E731

    def listing(rows: list[dict[str, Any]]) -> str:
        return results.markdown_table(
            ["model", "link", "workers", "setup", "switch (Gbit/s)", "method",
             "measured samples/s", "replay", "error", "queueing", "error", "Pollux", "error",
             "replay within 5%", "replay, run's compute", "error"],
            [[r["model"], r["link"],
              r["ranks"] if not r["traced"] else f"{r['ranks']} (traced)", r["setup"],
              f"{r['switch_bps'] / 1e9:.1f}", r["method"], round(r["measured_samples_s"], 2),
              round(r["replay_samples_s"], 2), pct(r["replay_error"]),
              round(r["queueing_samples_s"], 2), pct(r["queueing_error"]),
              round(r["pollux_samples_s"], 2), pct(r["pollux_error"]),
              "yes" if abs(r["replay_error"]) <= TOLERANCE else "NO",
              round(r["replay_cpu_samples_s"], 2), pct(r["replay_cpu_error"])] for r in rows])
    table = listing(rows)
    notes = []
    if excluded:
        notes.append("Runs left out of the table above (--exclude), predicted the same way: "
                     f"{args.exclude_why or 'see the command'}")
        notes.append(listing([r for r in every if r["setup"] in excluded]))
    if measured:
        notes.append(f"Predictions recomputed (--reuse) from the runs of: {measured}")
    summary = []
    for name in ("replay", "queueing", "pollux", "replay_cpu"):
        errs = [abs(r[f"{name}_error"]) for r in rows if not r["traced"]]
        if errs:
            summary.append([name, len(errs), f"{sum(errs) / len(errs):.1%}", f"{max(errs):.1%}",
                            sum(e <= TOLERANCE for e in errs)])
    if summary:
        notes.append("Predicted points (3+ workers), absolute error of samples/s:")
        notes.append(results.markdown_table(["model", "points", "mean", "worst", "within 5%"],
                                            summary))
    cost = [(r["cost_s"]["replay"], r["cost_s"]["queueing"]) for r in rows]
    if cost:
        notes.append(f"Cost per prediction (one worker count, one schedule, incl. N=1 "
                     f"baseline): replay {1e3 * sum(c[0] for c in cost) / len(cost):.1f} ms, "
                     f"queueing {1e3 * sum(c[1] for c in cost) / len(cost):.2f} ms (mean); "
                     "Pollux: a closed form once fitted.")
    notes.append("Per run: the link as measured, the compute-only rounds (requested: "
                 f"{args.compute}), for the traced runs the traced iteration and compute "
                 "(slowest rank, dear in DeAR's order: the replay's input; a traced compute far "
                 "above the compute-only rounds is a trace taken while the machine was "
                 "overloaded), and the load average (1 min) before and after:")
    drifts = {rep["setup"]: emulated_validate.drift(rep) for rep in reps if "extra" in rep}
    notes.append(results.markdown_table(
        ["setup", "link measured (Gbit/s)", "compute-only (ms)", "traced iteration (ms)",
         "traced compute (ms)", "load before", "load after"],
        [[rep["setup"], f"{(rep.get('bandwidth_measured_bps') or 0) / 1e9:.3f}",
          round(rep["t_compute_s"] * 1e3),
          round(drifts[rep["setup"]]["traced_iteration_s"] * 1e3) if rep["setup"] in drifts
          else "-",
          round(drifts[rep["setup"]]["traced_compute_s"] * 1e3) if rep["setup"] in drifts
          else "-", f"{rep['loadavg_before'][0]:.2f}",
          f"{rep['loadavg_after'][0]:.2f}"] for rep in reps]))
    notes.append(
        "Replay and queueing: from the 2-rank trace only (its compute, its collectives' fitted "
        "cost, torch's all-reduce probed in that run), at each run's measured link rate (the "
        "traced kinds' efficiencies kept) and, for a run with scaled parameters, the scaled "
        "parameter sizes. Pollux: fitted to 1 worker (the 2-rank run's compute-only rounds) "
        "and 2 workers (the method's measured time), one GPU per node, as AdaptDL's "
        "fit_perf_params does (beta pinned without more than 2 workers: its step time stays "
        "at the 2-worker one). \"replay, run's compute\": the replay with the compute "
        "multiplied by the run's compute-only time over the 2-rank run's (the 2-core "
        "machine's own slowdown of the emulated compute at 6-8 ranks, which a cluster with "
        "a CPU per worker does not have; measured, so not a prediction). Methods: ddp (25 MB "
        "buckets, Gloo) and dear (its default "
        "planned schedule, DEAR_PLAN_AFTER=2, DEAR_ROW_SPARSE=off). Scaled setups (last "
        f"field of the setup, 1/s size at rate L/s) emulate the full model at L. Load average "
        f"(1 min) at the end: {os.getloadavg()[0]:.2f}; traces kept in {workdir}.")
    print(table)
    results.write(args.name, "Throughput vs workers: dear.diagnose scale against the emulated "
                  "cluster", {"shaping": shaping, "rows": rows, "reports": reps}, table,
                  "\n\n".join(notes), figure=(lambda p: plot(rows, p)) if rows else None)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = emulated_bench.parse_args(argv, _extend)
    if args.methods == emulated_bench.DEFAULT_METHODS:
        args.methods = METHODS
    if args.name == "emulated":
        args.name = "scale_validation"
    if args.reuse:                       # results JSONs or reports.json, comma-separated
        olds = []
        for path in args.reuse.split(","):
            with open(path) as fh:
                olds.append(json.load(fh))
        # A setup measured again in a later file replaces the earlier one.
        latest = {rep["setup"]: rep for old in olds for rep in old["reports"]}
        write(args, list(latest.values()), olds[0]["shaping"], "(reused)",
              "; ".join(f"`{old['command']}` ({old['date']})" for old in olds))
        return 0
    from benchmarks.cluster import check_can_shape
    shaping = not args.no_shaping
    if shaping and (why := check_can_shape()):
        raise SystemExit(f"scale_validate: {why}: the validation needs shaped links")
    run(args, shaping)
    return 0


if __name__ == "__main__":
    sys.exit(main())
