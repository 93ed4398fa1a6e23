"""dear.diagnose: where the time of a data-parallel iteration goes, and what-if predictions.

- `trace(model, optimizer, out=..., iterations=range(10, 20))`: a context manager recording per
  rank a Chrome trace (Perfetto, chrome://tracing) of module forward/backward spans, updates,
  step and every collective, rank clocks aligned (also DEAR_TRACE=dir for dear's optimizer).
- `build_report(path)`: per iteration compute, communication, exposed communication, overlap
  ratio, idle gaps, slowest layers, buckets and rank; `plot_timeline` draws the lanes (PNG).
- `Simulator(path).predict(...)` / `predict_iteration_time(path, ...)`: replay the traced
  iteration's dependency graph under another schedule, bandwidth, latency, world size,
  fusion threshold or DeAR fusion layout (`fusion=FusionConfig(...)`; the objective of
  dear.autotune.offline's tuner). `Simulator(path, contention=fit_contention(overlapped,
  clean))` also models compute slowed by communication on the same CPU.
- `scaling_curve(path, workers, topology=Topology(...))`: throughput, speed-up and efficiency
  vs workers per schedule, by the replay and a closed-form queueing model (docs: "How many
  workers?").
Command line: `python -m dear.diagnose report|simulate|scale TRACE_DIR ...`.
"""

from .chrome import Trace, load_trace
from .costmodel import CostModel
from .plot import plot_timeline
from .report import Report, build_report, format_report
from .scale import ScalingCurve, scaling_curve
from .simulate import Prediction, Schedule, Simulator, fit_contention, predict_iteration_time
from .topology import Topology
from .trace import Tracer, trace

__all__ = ["CostModel", "Prediction", "Report", "ScalingCurve", "Schedule", "Simulator",
           "Topology", "Trace", "Tracer", "build_report", "fit_contention", "format_report",
           "load_trace", "plot_timeline", "predict_iteration_time", "scaling_curve", "trace"]
