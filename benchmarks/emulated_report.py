"""The emulated benchmark's report (benchmarks.emulated_bench): the bounds an iteration is
compared with, each method's summary over ranks and rounds, the Markdown table and the chart.

Kept apart from the scenario so that other scenarios on the emulated accelerator
(benchmarks.emulated_validate, benchmarks.bench, benchmarks.demo) report the same way.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Callable, Optional, Sequence

from benchmarks import emulated, results
from benchmarks.methods import Method

LOSS_RTOL = 1e-3


def dependency_bound(forward: Sequence[float], backward: Sequence[float],
                     comm: Sequence[float]) -> float:
    """A lower bound on the iteration from the layers' dependencies, for any schedule that
    overlaps a layer's reduce-scatter + all-gather (c_j seconds of link) with compute: layer k's
    gradient is ready at R_k = F + sum_{j>=k} b_j (backward runs n..1), the link must still
    carry layers 1..k's communication after it, and the next forward needs layers 1..k by
    T + sum_{i<k} f_i. So T >= max(T_comm, max_k R_k + sum_{j<=k} c_j - sum_{i<k} f_i).
    Why: max(T_compute, T_comm) ignores that the first layers' gradients are ready last and
    needed first (BERT-Base's word embedding: 1.2 x T_lb)."""
    if not len(forward) == len(backward) == len(comm):
        raise ValueError("one forward, backward and comm time per layer")
    total_f = sum(forward)
    best = sum(comm)
    later_b = sum(backward)                  # sum_{j>=k} b_j
    done_c = earlier_f = 0.0                 # sum_{j<=k} c_j, sum_{i<k} f_i
    for f, b, c in zip(forward, backward, comm):
        done_c += c
        best = max(best, total_f + later_b + done_c - earlier_f)
        later_b -= b
        earlier_f += f
    return best


def layer_dependency_bound(model_spec: emulated.ModelSpec, fwd: float, bwd: float,
                      t_comm: float) -> float:
    """dependency_bound with the layers' requested times scaled to the measured forward and
    backward (+ step) and c_j = T_comm x layer j's share of the bytes (the measured rate)."""
    kf = fwd / model_spec.forward_total if model_spec.forward_total else 0.0
    kb = bwd / model_spec.backward_total if model_spec.backward_total else 0.0
    numel = [layer.numel for layer in model_spec.layers]
    total = max(sum(numel), 1)
    return dependency_bound([t * kf for t in model_spec.forward_s],
                            [t * kb for t in model_spec.backward_s],
                            [t_comm * x / total for x in numel])


def _phase_medians(per_rank: list[list[dict[str, Any]]]) -> dict[str, float]:
    """Per phase: each rank's median over every round's timed iterations, slowest rank."""
    out = {}
    for key in ("total", "forward", "backward", "step"):
        out[key] = max(statistics.median([t for run in runs for t in run["times"][key]])
                       for runs in per_rank)
    return out


def _rows_sent(runs: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """Per table sent by rows: (its rows, the median rows sent per timed iteration)."""
    steps = [st for run in runs for st in run.get("rows_sent", [])]
    return {name: (rows, statistics.median(st[name][1] for st in steps))
            for name, (rows, _) in (steps[0].items() if steps else ())}


def _commits(per_rank: list[list[dict[str, Any]]]) -> Optional[dict[str, Any]]:
    """A method that commits (benchmarks.methods' commit=K): each commit's slowest rank, the
    state one rank copies, ms per MB."""
    rows = [[run.get("commit") for run in runs] for runs in per_rank]
    if any(row is None for runs in rows for row in runs):
        return None
    seconds = [max(s) for k in range(len(rows[0]))
               for s in zip(*(runs[k]["seconds"] for runs in rows))]
    mb = rows[0][0]["mb"]
    median = statistics.median(seconds) if seconds else float("nan")
    return {"count": len(seconds), "median_s": median, "max_s": max(seconds, default=None),
            "state_mb": mb, "ms_per_mb": median * 1e3 / mb if mb else None}


def summarize(gathered: list[dict[str, Any]], methods: list[Method],
              model_spec: emulated.ModelSpec, comm: dict[str, float], t_comm: float,
              args: argparse.Namespace) -> dict[str, Any]:
    world = len(gathered)
    base = _phase_medians([g["compute"] for g in gathered])
    t_compute = base["total"]
    t_lb = max(t_compute, t_comm)
    # the bounds from the measured compute (what T_lb uses), not the requested sleeps
    fwd, bwd = base["forward"], base["backward"] + base["step"]
    report: dict[str, Any] = {
        "model": args.model, "ranks": world, "scale": args.scale,
        "tokens": (args.tokens if any(layer.name in emulated.WORD_EMBEDDINGS
                                      for layer in model_spec.layers) else 0),
        "numel": model_spec.numel, "gradient_mb": model_spec.numel * 4 / 2**20,
        "batch_per_rank": args.batch, "t_comm_s": t_comm, "comm_s": comm,
        "t_compute_s": t_compute, "compute_phases_s": base,
        "emulated_forward_s": model_spec.forward_total,
        "emulated_backward_s": model_spec.backward_total, "t_lb_s": t_lb,
        "dear_bound_s": max(fwd, t_comm / 2) + max(bwd, t_comm / 2),
        "ddp_bound_s": fwd + max(bwd, t_comm),
        "dep_bound_s": layer_dependency_bound(model_spec, fwd, bwd, t_comm),
        "bandwidth_measured_bps": float(os.environ.get("BENCH_CLUSTER_BANDWIDTH_MEASURED", 0))
        or None, "methods": {}}
    ref = None
    for method in methods:
        per_rank = [g["runs"][method.label] for g in gathered]
        ph = _phase_medians(per_rank)
        totals = sorted(t for runs in per_rank for run in runs for t in run["times"]["total"])
        q = statistics.quantiles(totals, n=4) if len(totals) > 1 else [totals[0]] * 3
        runs0 = per_rank[0]
        cpu = statistics.mean(run["cpu_s"] / args.iters for runs in per_rank for run in runs)
        # per round, each timed iteration's slowest rank: stalls show here, not in medians
        iters = [[max(ts) for ts in zip(*(runs[k]["times"]["total"] for runs in per_rank))]
                 for k in range(len(per_rank[0]))]
        res = {
            "median_s": ph["total"], "q1_s": q[0], "q3_s": q[2],
            # what a step every K iterations adds shows in the mean, not the median
            "mean_s": statistics.mean(t for rnd in iters for t in rnd),
            "commit": _commits(per_rank),
            "iters_s": iters,
            "row_sparse": _rows_sent(runs0),
            "forward_s": ph["forward"], "backward_s": ph["backward"], "step_s": ph["step"],
            "forward_wait_s": ph["forward"] - base["forward"],
            "backward_extra_s": ph["backward"] - base["backward"],
            "step_wait_s": ph["step"] - base["step"],
            "ratio_lb": ph["total"] / t_lb,
            "ratio_dep": ph["total"] / report["dep_bound_s"],
            "samples_per_s": args.batch * world / ph["total"],
            "cpu_s_per_iter_per_rank": cpu,
            "ranks_cores": cpu * world / ph["total"],   # cores the ranks' processes kept busy
            "machine_busy_cores": statistics.mean(r["machine_busy"] for r in runs0)
            * (os.cpu_count() or 1),
            "loadavg": max(r["loadavg"] for r in runs0),
            "losses": runs0[0]["losses"],
            "setup_s": statistics.mean(r["setup_s"] for r in runs0),
            "teardown_s": statistics.mean(r["teardown_s"] for r in runs0),
        }
        rounds_agree = all(_rel_diff(r["losses"], runs0[0]["losses"]) <= LOSS_RTOL for r in runs0)
        res["rounds_agree"] = rounds_agree
        if method.label == "ddp":
            ref = res["losses"]
        report["methods"][method.label] = res
    ddp = report["methods"].get("ddp")
    for res in report["methods"].values():
        res["ratio_ddp"] = res["median_s"] / ddp["median_s"] if ddp else None
        if ref is not None:
            res["loss_rel_diff"] = _rel_diff(res["losses"], ref)
            res["loss_matches_ddp"] = res["loss_rel_diff"] <= LOSS_RTOL
    return report


def _rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)


def table(reports: list[dict[str, Any]]) -> tuple[str, str]:
    rows = []
    for rep in reports:
        where = f"{rep['model']} x{rep['ranks']}" + (f" (1/{rep['scale']})" if rep["scale"] > 1
                                                     else "")
        for label, r in rep["methods"].items():
            rows.append([where, label, round(r["median_s"] * 1e3),
                         round((r["q3_s"] - r["q1_s"]) * 1e3), round(r["ratio_lb"], 3),
                         round(r["ratio_dep"], 3) if "ratio_dep" in r else "-",
                         round(r["ratio_ddp"], 3) if r.get("ratio_ddp") else "-",
                         round(r["forward_wait_s"] * 1e3), round(r["backward_extra_s"] * 1e3),
                         round(r["step_wait_s"] * 1e3), round(r["cpu_s_per_iter_per_rank"], 3),
                         round(r["ranks_cores"], 2), round(r["machine_busy_cores"], 2),
                         ("ok" if r.get("loss_matches_ddp", True) else "DIFFERS")
                         + ("" if r["rounds_agree"] else ", rounds differ")])
    headers = ["setup", "method", "iter (ms)", "IQR (ms)", "x T_lb", "x dep bound", "x DDP",
               "fwd wait (ms)",
               "bwd extra (ms)", "step wait (ms)", "CPU s/iter/rank", "ranks' cores",
               "busy cores",
               "loss vs DDP"]
    notes = []
    for rep in reports:
        link = rep.get("bandwidth_measured_bps")
        notes.append(
            f"- {rep['model']} x{rep['ranks']}: gradient {rep['gradient_mb']:.1f} MB"
            + (f" (every parameter's first dimension / {rep['scale']}: fewer bytes for the "
               f"cores' network work, with a slower link to keep T_comm ~ 1 s)"
               if rep["scale"] > 1 else "")
            + (f" (word embedding: only the rows of {rep['tokens']} tokens per rank are "
               "non-zero, as in a fine-tune)" if rep.get("tokens") else "")
            + f"; T_compute {rep['t_compute_s'] * 1e3:.0f} ms (emulated forward "
            f"{rep['emulated_forward_s'] * 1e3:.0f} + backward "
            f"{rep['emulated_backward_s'] * 1e3:.0f}"
            f"); T_comm {rep['t_comm_s'] * 1e3:.0f} ms (all_reduce "
            f"{rep['comm_s']['all_reduce'] * 1e3:.0f}, dear rs+ag "
            f"{rep['comm_s']['rs_ag'] * 1e3:.0f})"
            f"; T_lb {rep['t_lb_s'] * 1e3:.0f} ms; bounds x T_lb: DeAR "
            f"{rep['dear_bound_s'] / rep['t_lb_s']:.2f}, DDP "
            f"{rep['ddp_bound_s'] / rep['t_lb_s']:.2f}"
            + (f", dependency {rep['dep_bound_s'] / rep['t_lb_s']:.2f}" if "dep_bound_s" in rep
               else "")
            + f"; link {rep.get('bandwidth_requested') or 'loopback'}"
            + (f", measured {link / 1e9:.3f} Gbit/s" if link else "")
            + (f", TCP {rep['congestion']}" if rep.get("congestion") else "")
            + f"; load average before/after {rep['loadavg_before'][0]:.2f}/"
            f"{rep['loadavg_after'][0]:.2f}" + _overshoot(rep))
        for label, r in rep["methods"].items():
            c = r.get("commit")
            if c and c["count"]:
                notes.append(
                    f"- {rep['model']} x{rep['ranks']} {label}: {c['count']} commits of "
                    f"{c['state_mb']:.0f} MB, median {c['median_s'] * 1e3:.0f} ms (max "
                    f"{c['max_s'] * 1e3:.0f}), {c['ms_per_mb']:.2f} ms/MB; mean iteration "
                    f"{r['mean_s'] * 1e3:.0f} ms" + "".join(
                        f", {other} {o['mean_s'] * 1e3:.0f} ms (x{r['mean_s'] / o['mean_s']:.3f})"
                        for other, o in rep["methods"].items() if not o.get("commit")))
    return results.markdown_table(headers, rows), "\n".join(notes)


def _overshoot(rep: dict[str, Any]) -> str:
    """A warning when the compute measured alone ran well past the requested sleeps: sleepers
    woken late on a loaded machine; T_lb (and every ratio) is then unreliable."""
    requested = rep["emulated_forward_s"] + rep["emulated_backward_s"]
    over = rep["t_compute_s"] / requested - 1 if requested else 0.0
    return (f"; WARNING: T_compute {100 * over:.0f}% above the requested compute (a loaded "
            "machine woke the sleepers late): ratios to T_lb unreliable" if over > 0.1 else "")


EXPLAIN = """Emulated accelerator (benchmarks/emulated.py): every layer keeps the real model's
parameters; its forward and backward sleep their FLOP share of the compute time (backward = 2 x
forward), so the cores are left to the network, as on a GPU cluster. fwd wait, bwd extra and step
wait: the method's forward, backward and step() minus the same phases with no communication
(DDP waits for its all-reduces inside backward; DeAR for its all-gathers in forward and its
reduce-scatters in step()). CPU s/iter/rank: CPU time of a rank's process (all threads) per
iteration; ranks' cores: the cores all ranks' processes kept busy (CPU s x ranks / iteration);
busy cores: the whole machine's (/proc/stat; the kernel's network work and anything else running
on the machine included)."""


def chart(reports: list[dict[str, Any]]) -> Callable[[str], None]:
    return results.ratio_chart([results.Panel(
        f"{rep['model']} x{rep['ranks']}" + (f" (1/{rep['scale']})" if rep["scale"] > 1 else "")
        + f": T_lb {rep['t_lb_s'] * 1e3:.0f} ms",
        {m: r["ratio_lb"] for m, r in rep["methods"].items()},
        rep["dear_bound_s"] / rep["t_lb_s"]) for rep in reports], top=2.5)
