"""Every knob of dear in one place: a dataclass filled from arguments, then DEAR_* variables."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from typing import Any, Callable, ClassVar, Mapping, Optional, Union

_MB = 1024 * 1024


def auto_threshold(gradient_bytes: int) -> int:
    """The default fusion threshold: 25 MB (DDP's, DeAR's), or an eighth of the gradient when
    that is smaller (at least 1 MB). With only two or three buckets the link has nothing to
    send until a quarter of backward is over and the last reduce-scatter is large; smaller
    buckets are not better everywhere, and the replay did not predict where they cost
    (docs/benchmarks.md#the-default-fusion-threshold)."""
    return max(min(25 * _MB, gradient_bytes // 8), _MB)


def _parse_bytes(text: str) -> int:
    """Accept '25MB', '25M', '1048576', '0.5GB'; plain numbers are bytes."""
    value = text.strip().upper()
    number, scale = value, 1
    for suffix, size in (("GB", 1024**3), ("G", 1024**3), ("MB", _MB), ("M", _MB),
                         ("KB", 1024), ("K", 1024), ("B", 1)):
        if value.endswith(suffix):
            number, scale = value[: -len(suffix)], size
            break
    return int(_parse_finite(number) * scale)


def _parse_finite(text: str) -> float:
    """A float that is a number: nan and inf are refused (they would pass every comparison
    check, or fail later without the setting's name)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text.strip()!r}")
    return value


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0/true/false), got {text!r}")


class Autotune(str, enum.Enum):
    """How the fusion layout is tuned. ONLINE: Bayesian optimization on measured iterations;
    OFFLINE: on the iteration times dear.diagnose's simulator predicts from a traced window,
    then the few best confirmed with real iterations."""

    OFF = "off"
    ONLINE = "online"
    OFFLINE = "offline"

    def __bool__(self) -> bool:             # `if autotune:` keeps meaning "tune at all"
        return self is not Autotune.OFF


def parse_autotune(value: Union[bool, str, None, "Autotune"]) -> Autotune:
    """True / '1' / 'true' / 'online' -> ONLINE, False / None / '0' / 'false' -> OFF,
    'offline' -> OFFLINE."""
    if isinstance(value, Autotune):
        return value
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return Autotune.ONLINE if value else Autotune.OFF
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("online", "offline", "off"):
            return Autotune(text)
        try:
            return Autotune.ONLINE if _parse_bool(text) else Autotune.OFF
        except ValueError:
            pass
    raise ValueError(f"autotune must be True/False, 'online' or 'offline' (DEAR_AUTOTUNE: "
                     f"1/0/true/false/online/offline), got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """Runtime configuration. Each field has an environment variable, listed in
    docs/configuration.md (tests/test_docs.py checks the table against these fields)."""

    #: bytes of gradient per fusion bucket (DEAR_FUSION_THRESHOLD, e.g. "25MB"); None: 25 MB,
    #: or an eighth of the model's gradient bytes where that is smaller (`auto_threshold`).
    fusion_threshold: Optional[int] = None
    #: seconds a collective may wait before the process group reports a failure (DEAR_TIMEOUT).
    timeout: float = 300.0
    #: directory where dear.diagnose writes a trace of each DistributedOptimizer's run
    #: ("" = no tracing) (DEAR_TRACE).
    trace: str = ""
    #: directory where, when a collective fails, each rank writes which rank did not issue it
    #: and what every rank last issued (dear/comm/hang.py); "" = the system's temporary
    #: directory's dear-hang/ (DEAR_HANG_REPORT).
    hang_report: str = ""
    #: iterations DEAR_TRACE records, START:STOP counted from the optimizer's creation
    #: (DEAR_TRACE_ITERATIONS).
    trace_iterations: str = "10:20"
    #: "pairwise" (dear's bandwidth-optimal point-to-point schedule) or "native" (torch's own
    #: collectives) for reduce-scatter/all-gather on Gloo (DEAR_GLOO_COLLECTIVES).
    gloo_collectives: str = "pairwise"
    #: what carries reduce-scatters and all-gathers on the Horovod backend: "gloo" (dear's pairwise
    #: exchange on private Gloo groups, bandwidth-optimal) or "horovod" (Horovod's own
    #: collectives) (DEAR_HOROVOD_DATA_PLANE).
    horovod_data_plane: str = "gloo"
    #: what dear.init() (backend="auto") uses: "auto", "torch", "horovod", "local", "nccl" or
    #: "mpi" (DEAR_BACKEND); an explicit dear.init(backend=...) wins.
    backend: str = "auto"
    #: backend "mpi": "thread" (a helper thread drives MPI progress, so collectives overlap
    #: compute) or "none" (progress only inside wait()) (DEAR_MPI_PROGRESS).
    mpi_progress: str = "thread"
    #: seconds the MPI progress thread sleeps between two MPI_Testsome calls while a collective
    #: is in flight (DEAR_MPI_PROGRESS_INTERVAL).
    mpi_progress_interval: float = 1e-4
    #: log level of the "dear" logger (DEAR_LOG_LEVEL).
    log_level: str = "WARNING"
    #: use the C++ extension (csrc/) for bucket bookkeeping and packing where it was built;
    #: False forces the pure-Python path (DEAR_NATIVE).
    native: bool = True

    #: tune the fusion layout: "online" (or true/1) with Bayesian optimization on measured
    #: iterations, "offline" on the simulator's predictions, then confirmed (DEAR_AUTOTUNE).
    autotune: Autotune = Autotune.OFF
    #: at most this many online autotune trials (DEAR_AUTOTUNE_TRIALS).
    autotune_trials: int = 12
    #: offline: simulated trials (no training iteration each) (DEAR_AUTOTUNE_SIMULATED_TRIALS),
    #: and how many of the best predicted layouts are confirmed with real iterations, besides
    #: the current one (DEAR_AUTOTUNE_CONFIRM).
    autotune_simulated_trials: int = 40
    autotune_confirm: int = 3
    #: iterations timed per trial (median), after autotune_settle dropped (DEAR_AUTOTUNE_WINDOW,
    #: DEAR_AUTOTUNE_SETTLE).
    autotune_window: int = 5
    autotune_settle: int = 2
    #: JSON-lines log of the trials, written by rank 0 as they finish (DEAR_AUTOTUNE_LOG).
    autotune_log: str = "dear_autotune.jsonl"
    #: where the best layout is saved when tuning ends (DEAR_AUTOTUNE_OUT).
    autotune_out: str = "dear_fusion.json"
    #: a saved layout to use instead of the thresholds; skips tuning (DEAR_FUSION_CONFIG).
    fusion_config: str = ""
    #: bytes of the first bucket in forward order (reduced last, gathered first: on the critical
    #: path twice); 0: no special first bucket (DEAR_FIRST_BUCKET).
    first_bucket: int = 2 * _MB
    #: "planned": all-gather chunks also fill backward's idle link time, by a plan rank 0 makes
    #: from the first iterations; "dear": DeAR's order, all-gathers at step() (DEAR_SCHEDULE).
    schedule: str = "planned"
    #: iterations measured (in DeAR's order) before the plan is made, after each new layout
    #: (DEAR_PLAN_AFTER).
    plan_after: int = 4
    #: bytes of an all-gather chunk in backward's idle time (DEAR_CHUNK_BYTES).
    chunk_bytes: int = 1 * _MB
    #: share of each backward gap the plan leaves free of all-gather chunks (DEAR_PLAN_SLACK):
    #: its link costs are a model (a probe, scaled to the measured iterations), and a chunk that
    #: overruns delays every later reduce-scatter. A larger slack helped BERT-Base but slowed
    #: ResNet-50 on 4 ranks (docs/benchmarks.md#the-plans-slack).
    plan_slack: float = 0.1
    #: on CPU tensors, verify every plan: after its check, it alternates with DeAR's order in
    #: windows of plan_after iterations, 3 of each, and is kept only if its windows were
    #: faster (DEAR_PLAN_VERIFY; rank 0 decides, every rank follows). Off by default: it adds
    #: 6 x plan_after iterations before the schedule settles.
    plan_verify: bool = False
    #: on CPU tensors, make no plan (DeAR's order) where more than this share of the link time
    #: it would move into backward is host work taken from backward's compute
    #: (plan.contention: the probe's CPU per second of collective, backward's busy cores, the
    #: rank's cores; DEAR_PLAN_CONTENTION; 1: plan regardless). There the plan's model (link
    #: time is free beside compute) does not hold: on loopback Gloo with CPU compute a plan
    #: gained nothing, while the emulated accelerator (compute that frees the cores, a shaped
    #: link) has no contention (docs/benchmarks.md#no-plan-where-the-link-is-host-work).
    plan_contention: float = 0.5
    #: embedding tables sent as the rows some rank used (dear/fusion/rows.py): "auto" (the
    #: model's dense, untied nn.Embedding tables of 1 MB or more; nothing without model=),
    #: "off", or comma-separated parameter names (DEAR_ROW_SPARSE).
    row_sparse: str = "auto"
    #: each parameter's .grad is a view of its bucket's buffer: no second copy of the gradients
    #: in memory (DDP's gradient_as_bucket_view; dear/fusion/views.py)
    #: (DEAR_GRADIENT_AS_BUCKET_VIEW).
    gradient_as_bucket_view: bool = False
    #: each rank keeps and updates only its shards of the optimizer state (1/N of it); the
    #: all-gathers carry updated parameters (dear/sharding/state.py) (DEAR_SHARD_OPTIMIZER_STATE).
    shard_optimizer_state: bool = False
    #: compare the contents of the gradients and parameters (writes through `.data`,
    #: docs/contract.md) in every iteration of the first 8 of a layout, then in about one
    #: iteration in this many, the same on every rank; 1: every iteration; 0: never (writes
    #: that move autograd's version counter are seen in every iteration either way)
    #: (DEAR_CHECK_EVERY).
    check_every: int = 16
    #: elastic training (docs/elastic.md): where commits go, on storage every node reads
    #: (DEAR_ELASTIC_DIR; unset: a folder under the temp dir named after torchrun's run id,
    #: one machine only)
    elastic_dir: str = ""
    #: seconds a worker asked to stop (torchrun's agent's SIGTERM) waits for its next commit
    #: before it exits, below the agent's 30 s before SIGKILL (DEAR_ELASTIC_GRACE)
    elastic_grace: float = 25.0

    _ENV: ClassVar[dict[str, tuple[str, Callable[[str], Any]]]] = {
        "fusion_threshold": ("DEAR_FUSION_THRESHOLD", _parse_bytes),
        "autotune": ("DEAR_AUTOTUNE", parse_autotune),
        "autotune_trials": ("DEAR_AUTOTUNE_TRIALS", int),
        "autotune_simulated_trials": ("DEAR_AUTOTUNE_SIMULATED_TRIALS", int),
        "autotune_confirm": ("DEAR_AUTOTUNE_CONFIRM", int),
        "autotune_window": ("DEAR_AUTOTUNE_WINDOW", int),
        "autotune_settle": ("DEAR_AUTOTUNE_SETTLE", int),
        "autotune_log": ("DEAR_AUTOTUNE_LOG", str),
        "autotune_out": ("DEAR_AUTOTUNE_OUT", str),
        "fusion_config": ("DEAR_FUSION_CONFIG", str),
        "first_bucket": ("DEAR_FIRST_BUCKET", _parse_bytes),
        "schedule": ("DEAR_SCHEDULE", str),
        "plan_after": ("DEAR_PLAN_AFTER", int),
        "chunk_bytes": ("DEAR_CHUNK_BYTES", _parse_bytes),
        "plan_slack": ("DEAR_PLAN_SLACK", _parse_finite),
        "plan_verify": ("DEAR_PLAN_VERIFY", _parse_bool),
        "plan_contention": ("DEAR_PLAN_CONTENTION", _parse_finite),
        "row_sparse": ("DEAR_ROW_SPARSE", str),
        "gradient_as_bucket_view": ("DEAR_GRADIENT_AS_BUCKET_VIEW", _parse_bool),
        "shard_optimizer_state": ("DEAR_SHARD_OPTIMIZER_STATE", _parse_bool),
        "check_every": ("DEAR_CHECK_EVERY", int),
        "timeout": ("DEAR_TIMEOUT", _parse_finite),
        "trace": ("DEAR_TRACE", str),
        "hang_report": ("DEAR_HANG_REPORT", str),
        "trace_iterations": ("DEAR_TRACE_ITERATIONS", str),
        "gloo_collectives": ("DEAR_GLOO_COLLECTIVES", str),
        "horovod_data_plane": ("DEAR_HOROVOD_DATA_PLANE", str),
        "backend": ("DEAR_BACKEND", str),
        "mpi_progress": ("DEAR_MPI_PROGRESS", str),
        "mpi_progress_interval": ("DEAR_MPI_PROGRESS_INTERVAL", _parse_finite),
        "log_level": ("DEAR_LOG_LEVEL", str),
        "native": ("DEAR_NATIVE", _parse_bool),
        "elastic_dir": ("DEAR_ELASTIC_DIR", str),
        "elastic_grace": ("DEAR_ELASTIC_GRACE", _parse_finite),
    }

    def __post_init__(self) -> None:
        object.__setattr__(self, "autotune", parse_autotune(self.autotune))
        if self.fusion_threshold is not None and self.fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be >= 0 bytes, got {self.fusion_threshold}")
        for name in ("timeout", "plan_slack", "plan_contention", "mpi_progress_interval"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} ({self._ENV[name][0]}) must be a finite number, "
                                 f"got {getattr(self, name)}")
        if self.timeout <= 0:
            raise ValueError(f"timeout (DEAR_TIMEOUT) must be > 0 seconds, got {self.timeout}")
        if not (math.isfinite(self.elastic_grace) and self.elastic_grace > 0):
            raise ValueError("elastic_grace (DEAR_ELASTIC_GRACE) must be a positive number of "
                             f"seconds, got {self.elastic_grace}")
        start, _, stop = self.trace_iterations.partition(":")
        if not (start.strip().isdigit() and stop.strip().isdigit() and int(stop) > int(start)):
            raise ValueError(f"trace_iterations must be START:STOP with 0 <= START < STOP, "
                             f"e.g. '10:20', got {self.trace_iterations!r}")
        if self.autotune_trials < 1 or self.autotune_window < 1 or self.autotune_settle < 0:
            raise ValueError("autotune needs trials >= 1, window >= 1 and settle >= 0; got "
                             f"{self.autotune_trials}, {self.autotune_window}, "
                             f"{self.autotune_settle}")
        if self.autotune_simulated_trials < 1 or self.autotune_confirm < 1:
            raise ValueError("offline autotune needs simulated trials >= 1 and confirm >= 1; "
                             f"got {self.autotune_simulated_trials}, {self.autotune_confirm}")
        if self.schedule not in ("planned", "dear"):
            raise ValueError(f"schedule must be 'planned' or 'dear', got {self.schedule!r}")
        if self.check_every < 0:
            raise ValueError(f"check_every (DEAR_CHECK_EVERY) must be >= 0 iterations (1: "
                             f"every iteration, 0: never), got {self.check_every}")
        if self.plan_after < 2 or self.chunk_bytes < 1024:
            raise ValueError("plan_after must be >= 2 iterations and chunk_bytes >= 1KB; got "
                             f"{self.plan_after}, {self.chunk_bytes}")
        if not 0.0 <= self.plan_slack < 1.0:
            raise ValueError(f"plan_slack must be in [0, 1) (a share of each gap), got "
                             f"{self.plan_slack}")
        if not 0.0 <= self.plan_contention <= 1.0:
            raise ValueError(f"plan_contention (DEAR_PLAN_CONTENTION) must be in [0, 1] (a "
                             f"share of the link time; 1: plan regardless), got "
                             f"{self.plan_contention}")
        if self.gloo_collectives not in ("pairwise", "native"):
            raise ValueError(
                f"gloo_collectives must be 'pairwise' or 'native', got {self.gloo_collectives!r}")
        if self.mpi_progress not in ("thread", "none"):
            raise ValueError(f"mpi_progress must be 'thread' or 'none', got {self.mpi_progress!r}")
        if self.mpi_progress_interval < 0:
            raise ValueError(f"mpi_progress_interval must be >= 0 seconds, got "
                             f"{self.mpi_progress_interval}")
        if self.horovod_data_plane not in ("gloo", "horovod"):
            raise ValueError(f"horovod_data_plane must be 'gloo' or 'horovod', got "
                             f"{self.horovod_data_plane!r}")

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Each field's DEAR_* variable (configuration table, settings digest)."""
        return {field: var for field, (var, _parse) in cls._ENV.items()}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """Defaults, overridden by DEAR_* variables, overridden by explicit (non-None) arguments."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field, (var, parse) in cls._ENV.items():
            if var in environ:
                try:
                    values[field] = parse(environ[var])
                except (ValueError, OverflowError) as exc:
                    raise ValueError(f"{var}={environ[var]!r} is invalid: {exc}") from None
        for field, value in overrides.items():
            if field not in cls._ENV:
                raise TypeError(f"unknown dear option {field!r}")
            if value is not None:
                values[field] = value
        return cls(**values)
