"""The collectives' cost on N workers of a cluster: nodes of g GPUs, a faster link inside a node.

A node's GPUs share one inter-node link (`bandwidth_bps`, per-step `latency_s`); GPUs of a node
talk over `intra_bandwidth_bps` / `intra_latency_s` (NVLink, PCIe). Workers fill nodes in
order: N workers on ceil(N / g) nodes. Two ways to run a collective, as the backends do:

- flat ring (default; Gloo's and NCCL's ring over every rank): the ring leaves and enters each
  node once, every step moves one chunk over every hop at once, so a step lasts as long as its
  slowest hop: per kind, latency max(a_intra, a_inter) and rate min(r_intra, r_inter) once the
  ring spans two nodes; inside one node, the intra-node link alone.
- hierarchical (`hierarchical=True`; NCCL's tree-like 2D schedules, Horovod's
  HOROVOD_HIERARCHICAL_ALLREDUCE): reduce-scatter inside the node, the node's shards
  all-reduced (reduce-scattered, all-gathered) between nodes, all-gather inside the node.
  With l GPUs on each of m nodes, for an all-reduce of S bytes:
      2(l-1) a_i + 2(l-1)/l S / r_i + 2(m-1) a_x + 2(m-1)/m S / r_x
  (the node's l shards cross its one link together: (m-1)/m S each way, not S/l). Half of
  it for a reduce-scatter or an all-gather. A node that is not full is counted as full
  (an approximation at N not a multiple of g).

Either way the cost at one N is affine in the bytes, so it is a `CostModel` at that world size:
the simulator replays it unchanged. Each collective kind keeps the efficiency it had on the
traced link (fitted rate / traced link rate) on both links when `traced_bandwidth_bps` is
known, else runs at the link rate.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .costmodel import KINDS, CostModel, latency_steps, volume


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where N workers run. None for the inter-node link: as fitted from the trace."""

    bandwidth_bps: Optional[float] = None          # inter-node link of each node, bits/s
    latency_s: Optional[float] = None              # inter-node per-step latency
    gpus_per_node: int = 1
    intra_bandwidth_bps: Optional[float] = None    # inside a node (needed when gpus_per_node > 1)
    intra_latency_s: Optional[float] = None        # None: the inter-node latency
    hierarchical: bool = False
    traced_bandwidth_bps: Optional[float] = None   # the traced link's rate: keep efficiencies

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be an integer >= 1, got {self.gpus_per_node}")
        for name in ("bandwidth_bps", "intra_bandwidth_bps", "traced_bandwidth_bps"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 bits/s, got {value}")
        for name in ("latency_s", "intra_latency_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {value}")
        if self.gpus_per_node > 1 and self.intra_bandwidth_bps is None:
            raise ValueError(f"gpus_per_node={self.gpus_per_node}: give intra_bandwidth_bps "
                             "(--intra-bandwidth), the link between GPUs of a node")

    def nodes(self, n: int) -> int:
        return math.ceil(n / self.gpus_per_node)

    def describe(self) -> str:
        inter = ("as traced" if self.bandwidth_bps is None
                 else f"{self.bandwidth_bps / 1e9:g} Gbit/s")
        if self.latency_s is not None:
            inter += f" + {self.latency_s * 1e6:g} us/step"
        if self.gpus_per_node == 1:
            return f"1 GPU per node, inter-node link {inter}"
        intra = f"{(self.intra_bandwidth_bps or 0) / 1e9:g} Gbit/s"
        if self.intra_latency_s is not None:
            intra += f" + {self.intra_latency_s * 1e6:g} us/step"
        return (f"{self.gpus_per_node} GPUs per node (intra-node {intra}), inter-node link "
                f"{inter}, {'hierarchical' if self.hierarchical else 'flat ring'} collectives")

    def cost(self, fitted: Optional[CostModel], n: int) -> CostModel:
        """The collectives' cost model at `n` workers (`fitted`: the trace's, or None)."""
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"worker counts must be integers >= 1, got {n!r}")
        inter = self._inter(fitted, n)
        if self.gpus_per_node == 1:
            return inter
        intra = self._intra(fitted, inter, n)
        if n <= self.gpus_per_node:
            return intra
        if not self.hierarchical:
            return CostModel({k: max(inter.alpha[k], intra.alpha[k]) for k in inter.alpha},
                             {k: min(inter.rate[k], intra.rate[k]) for k in inter.rate}, n)
        local, m = self.gpus_per_node, self.nodes(n)
        alpha, rate = {}, {}
        for k in inter.rate:
            if k == "broadcast":               # kept flat: rarely on the critical path
                alpha[k], rate[k] = (max(inter.alpha[k], intra.alpha[k]),
                                     min(inter.rate[k], intra.rate[k]))
                continue
            twice = 2 if k == "all_reduce" else 1
            intercept = twice * ((local - 1) * intra.alpha[k] + (m - 1) * inter.alpha[k])
            slope = twice * ((local - 1) / local / intra.rate[k] + (m - 1) / m / inter.rate[k])
            alpha[k] = intercept / latency_steps(k, n)
            rate[k] = volume(k, 1.0, n) / slope
        return CostModel(alpha, rate, n)

    def _inter(self, fitted: Optional[CostModel], n: int) -> CostModel:
        if fitted is None:
            if self.bandwidth_bps is None:
                raise ValueError("the trace holds no collective to fit the network on (one "
                                 "rank?); give the link: bandwidth_bps / --bandwidth")
            return CostModel.ideal(self.bandwidth_bps, self.latency_s or 0.0, n)
        return fitted.what_if(self.bandwidth_bps, self.latency_s, n, self.traced_bandwidth_bps)

    def _intra(self, fitted: Optional[CostModel], inter: CostModel, n: int) -> CostModel:
        bw = float(self.intra_bandwidth_bps or 0.0)
        if fitted is not None and self.traced_bandwidth_bps:
            eff = {k: fitted.rate[k] / (self.traced_bandwidth_bps / 8) for k in fitted.rate}
        else:
            eff = {k: 1.0 for k in KINDS}
        lat = self.intra_latency_s
        return CostModel({k: inter.alpha[k] if lat is None else lat for k in inter.alpha},
                         {k: eff.get(k, 1.0) * bw / 8 for k in inter.rate}, n)
