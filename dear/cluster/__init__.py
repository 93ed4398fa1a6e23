"""How a shared cluster's scheduler divides workers among jobs, simulated: jobs arrive with
their throughput-vs-workers curves, a policy allocates, the simulation reports completion times.
`python -m dear.cluster simulate --help`; docs/sharing-a-cluster.md. No torch: numpy only (and
matplotlib for the plot)."""

from .curves import (
                     CommModelCurve,
                     LinearCurve,
                     PolluxCurve,
                     TableCurve,
                     ThroughputCurve,
                     as_curve,
                     from_scaling_curve,
)
from .experiment import Comparison, compare
from .metrics import summarize
from .policies import FIFO, SRTF, Optimus, Pollux, Tiresias, make_policy
from .simulator import JobRecord, JobView, SimulationResult, simulate
from .workload import Job, generate, load_jobs

__all__ = ["ThroughputCurve", "TableCurve", "CommModelCurve", "PolluxCurve", "LinearCurve",
           "as_curve", "from_scaling_curve", "Job", "generate", "load_jobs", "simulate",
           "SimulationResult", "JobRecord", "JobView", "FIFO", "SRTF", "Tiresias", "Optimus",
           "Pollux", "make_policy", "summarize", "compare", "Comparison"]
