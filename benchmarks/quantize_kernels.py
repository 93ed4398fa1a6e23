"""What block quantization costs per byte: dear's native quantize/dequantize kernels
(csrc/quantize.cpp on CPU, csrc/cuda/quantize_kernels.cu on a GPU) against the bytes they save.

For each device, bit width and size: the median time of `quantize` (with error feedback: the
residual read and rewritten) and of `dequantize` (accumulating, as the reduce phase's sum
does), as GB/s of fp32 input, and the plain torch reference's time beside them. A quantized
bucket costs, per rank and iteration, one quantize and one dequantize of every element on the
reduce side and again on the gather side (dear/fusion/quantized.py), so these rates say at what
link speed int8 stops paying: when 4 passes over the bucket take longer than sending the 3/4
of its bytes int8 saves.

    python -m benchmarks.quantize_kernels                  # CPU, and CUDA where there is one
    python -m benchmarks.quantize_kernels --devices cpu --sizes 1M,4M
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

from dear import native
from dear.fusion.quantize import (code_bytes, dequantize, dequantize_reference, num_blocks,
                                  quantize, quantize_reference)

from . import results


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _timer(device: str) -> Callable[[Callable[[], None], int], float]:
    """Median seconds of fn over `reps` calls: CUDA events on a GPU (kernel time, the host's
    launch overlapped), perf_counter on CPU."""
    def run(fn: Callable[[], None], reps: int) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            if device == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)
    return run


def measure(device: str, bits: int, numel: int, block: int, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(numel, generator=gen).to(device)
    residual = torch.zeros(numel, device=device)
    codes = torch.empty(code_bytes(numel, bits), dtype=torch.int8 if bits == 8 else torch.uint8,
                        device=device)
    scales = torch.empty(num_blocks(numel, block), device=device)
    out = torch.zeros(numel, device=device)
    timer = _timer(device)
    row: dict[str, Any] = {"device": device, "bits": bits, "numel": numel, "block": block}
    cases = {
        "quantize": lambda: quantize(x, residual, codes, scales, block, bits),
        "dequantize": lambda: dequantize(codes, scales, out, block, bits, True),
        "quantize_ref": lambda: quantize_reference(x, residual, codes, scales, block, bits),
        "dequantize_ref": lambda: dequantize_reference(codes, scales, out, block, bits, True),
    }
    for name, fn in cases.items():
        seconds = timer(fn, reps if not name.endswith("_ref") else max(3, reps // 4))
        row[f"{name}_us"] = seconds * 1e6
        row[f"{name}_gbps"] = numel * 4 / seconds / 1e9
    return row


def _speedup(row: dict[str, Any]) -> float:
    return ((row["quantize_ref_us"] + row["dequantize_ref_us"])
            / (row["quantize_us"] + row["dequantize_us"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cpu,cuda",
                        help="comma-separated; cuda is left out where there is no GPU")
    parser.add_argument("--sizes", default="256K,4M,25M", help="fp32 elements per call")
    parser.add_argument("--bits", default="8,4")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads on CPU (0: leave torch's default)")
    parser.add_argument("--name", default="quantize_kernels")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [d for d in args.devices.split(",")
               if d == "cpu" or (d == "cuda" and torch.cuda.is_available())]
    built = native.build_info()
    rows = []
    for device in devices:
        for bits in (int(b) for b in args.bits.split(",")):
            for numel in (_size(s) for s in args.sizes.split(",")):
                row = measure(device, bits, numel, args.block, args.reps)
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items()), flush=True)
                rows.append(row)
    headers = ["device", "bits", "elements", "quantize (us)", "GB/s", "dequantize+ (us)",
               "GB/s", "torch reference q / dq (us)", "q+dq vs reference"]
    table = results.markdown_table(headers, [
        [r["device"], r["bits"], r["numel"], r["quantize_us"], r["quantize_gbps"],
         r["dequantize_us"], r["dequantize_gbps"],
         f"{r['quantize_ref_us']:.0f} / {r['dequantize_ref_us']:.0f}",
         f"{_speedup(r):.1f}x"]
        for r in rows])
    notes = (f"Native extension: {built}. GB/s counts the fp32 values read (4 bytes each); "
             f"quantize adds and renews the residual (error feedback), dequantize accumulates "
             f"into its output (the reduce phase's sum); block {args.block}. On a GPU: CUDA "
             f"events around one call (kernel time). CPU threads: {torch.get_num_threads()}.")
    md = results.write(args.name, "Block quantization kernels: time per call", {"rows": rows},
                       table, notes)
    print(md)


if __name__ == "__main__":
    main()
