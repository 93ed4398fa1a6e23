"""benchmarks/quantized_accuracy.py on a tiny budget (the CNN, 1 epoch, 1 seed, fp32 and int8)
through its Python entry point: the three files are written, fp32's applied gradient is the
exact average, int8's is close to it but not equal."""

import json

from benchmarks import quantized_accuracy


def test_tiny_run_writes_its_files_and_measures_the_gradient_error(tmp_path):
    rc = quantized_accuracy.main([
        "--models", "cnn", "--epochs", "1", "--seeds", "0", "--methods", "fp32,int8",
        "--out", str(tmp_path), "--name", "tiny", "--timeout", "45"])
    assert rc == 0
    for f in ("tiny.json", "tiny.md", "tiny_error.png"):
        assert (tmp_path / f).stat().st_size > 0, f
    with open(tmp_path / "tiny.json") as fh:
        report = json.load(fh)
    runs = {r["method"]: r for r in report["runs"]}
    assert set(runs) == {"fp32", "int8"}
    steps = 1437 // 64
    for r in runs.values():
        assert len(r["grad_error"]) == steps
        assert 0.0 <= r["accuracy"] <= 1.0 and r["train_loss"] > 0
    assert max(runs["fp32"]["grad_error"]) < 1e-6
    assert min(runs["int8"]["grad_error"]) > 0 and max(runs["int8"]["grad_error"]) < 0.1
    summary = report["summary"]["cnn"]
    assert summary["fp32"]["verdict"] == "reference"
    assert summary["int8"]["within_fp32_spread"] in (True, False)
    md = (tmp_path / "tiny.md").read_text()
    assert "Command:" in md and "Commit:" in md and "tiny_error.png" in md
