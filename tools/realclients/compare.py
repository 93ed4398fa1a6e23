"""Compare the final states saved by the DDP and dear runs of each scenario.

usage: compare.py OUT_DIR SCENARIO [SCENARIO ...]
Reads OUT_DIR/<scenario>/{ddp,dear}_rank{0,1}.pt (written at the end of each training script:
{"model": state_dict, "param_names": [...], "model_ema": state_dict (with --model-ema)}).
Prints, per scenario, the max |a - b| over
  params / buffers / ema   for  DDP vs dear on rank 0, on rank 1,
                                rank 0 vs rank 1 inside DDP, inside dear,
                                and DDP vs a repeated DDP run (ddp2, the noise floor; "missing"
                                where the scenario has no repeat).
"missing" = a run produced no file (it failed: see its log); "keys!" = the two state dicts have
different keys (the differing keys are printed below the table).
"""
import os
import sys

import torch


def load(path):
    if not os.path.exists(path):
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def split(state):
    """-> {"params": {...}, "buffers": {...}, "ema": {...}} of float64 tensors."""
    if state is None:
        return None
    names = state.get("param_names")
    out = {"params": {}, "buffers": {}, "ema": {}}
    for k, v in state["model"].items():
        is_param = k in names if names is not None else not k.endswith(
            ("running_mean", "running_var", "num_batches_tracked"))
        out["params" if is_param else "buffers"][k] = v.detach().double()
    for k, v in (state.get("model_ema") or {}).items():
        out["ema"][k] = v.detach().double()
    return out


def maxdiff(a, b, group, notes, label):
    if a is None or b is None:
        return "missing"
    da, db = a[group], b[group]
    if not da and not db:
        return "-"
    if set(da) != set(db):
        notes.append(f"{label} {group}: keys only in first {sorted(set(da) - set(db))[:5]}, "
                     f"only in second {sorted(set(db) - set(da))[:5]}")
        return "keys!"
    m, worst, ndiff = 0.0, None, 0
    for k in da:
        if da[k].shape != db[k].shape:
            notes.append(f"{label} {group}: {k} shape {tuple(da[k].shape)} vs {tuple(db[k].shape)}")
            return "shape!"
        if da[k].numel():
            d = (da[k] - db[k]).abs().max().item()
            ndiff += d > 0
            if d > m:
                m, worst = d, k
    if worst is not None:
        notes.append(f"{label} {group}: {ndiff}/{len(da)} tensors differ, largest in {worst}")
    return f"{m:.3g}"


def main():
    out_dir, scenarios = sys.argv[1], sys.argv[2:]
    cols = [("DDP-dear r0", "ddp", 0, "dear", 0), ("DDP-dear r1", "ddp", 1, "dear", 1),
            ("r0-r1 DDP", "ddp", 0, "ddp", 1), ("r0-r1 dear", "dear", 0, "dear", 1),
            ("DDP-DDP2 r0", "ddp", 0, "ddp2", 0)]
    groups = ("params", "buffers", "ema")
    header = f"{'scenario':<22} {'group':<8}" + "".join(f" {c[0]:>12}" for c in cols)
    print(header)
    print("-" * len(header))
    notes = []
    for sc in scenarios:
        st = {(v, r): split(load(os.path.join(out_dir, sc, f"{v}_rank{r}.pt")))
              for v in ("ddp", "dear", "ddp2") for r in (0, 1)}
        for g in groups:
            cells = [maxdiff(st[(va, ra)], st[(vb, rb)], g, notes, f"{sc} {name}")
                     for name, va, ra, vb, rb in cols]
            if g == "ema" and all(c in ("-", "missing") for c in cells[:4]):
                continue
            print(f"{sc:<22} {g:<8}" + "".join(f" {c:>12}" for c in cells))
        # scale: how far training moved the parameters is unknown here; print the largest |param|
        ref = st[("ddp", 0)]
        if ref is not None:
            big = max(v.abs().max().item() for v in ref["params"].values())
            print(f"{'':<22} {'(max |param| in DDP r0: ' + format(big, '.3g') + ')'}")
    for n in notes:
        print("note:", n)


if __name__ == "__main__":
    main()
