"""The native path (csrc/, dear.native) against the Python path of dear/fusion/bucket.py.

Bit-identity, not tolerance: two buckets built from one plan, one with the C++ bookkeeping and
pack, one without, are fed the same gradients and must hold the same bytes in their buffers and
wire buffers, for every dtype a bucket can have, odd sizes, padding (world sizes 1-3), missing
gradients, non-contiguous gradients, prescaling and fp16 compression.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import dear
from dear import native
from dear.comm.base import Communicator, DoneWork, Work
from dear.config import Config
from dear.fusion.bucket import Bucket
from dear.fusion.planner import plan_buckets

needs_native = pytest.mark.skipif(not native.native_available(),
                                  reason=f"native extension not built: {native.load_error()}")

SHAPES = [(3,), (5, 7), (1,), (13,), (2, 3, 4), (6, 5), (11,)]   # odd sizes
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
             torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equal only if bit-identical (signed zeros, NaNs)."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


class FakeComm(Communicator):
    """Records what was sent; 'reducing' keeps this rank's chunk (every rank sent the same)."""

    name = "fake"

    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank
        self.sent: list[torch.Tensor] = []

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def reduce_scatter(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        self.sent.append(input.clone())
        output.copy_(input.view(self._size, -1)[self._rank])
        return DoneWork()

    def all_gather(self, input: torch.Tensor, output: torch.Tensor) -> Work:
        # As if every rank had sent what this one sent: the other shards are the sent bytes.
        output.copy_(self.sent[-1])
        output.view(self._size, -1)[self._rank].copy_(input)
        return DoneWork()

    def all_reduce(self, tensor: torch.Tensor) -> Work:
        return DoneWork()

    def broadcast(self, tensor: torch.Tensor, root: int) -> Work:
        return DoneWork()

    def broadcast_object(self, obj, root):
        return obj

    def all_gather_object(self, obj):
        return [obj] * self._size


def make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def make_grads(params: list[torch.nn.Parameter], seed: int, missing: set[int]
               ) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    grads: list[torch.Tensor | None] = []
    for i, p in enumerate(params):
        if i in missing:
            grads.append(None)
            continue
        grad = (torch.randn(p.shape, generator=g) * 3).to(p.dtype)
        if grad.dim() == 2:          # a non-contiguous gradient with the parameter's shape
            grad = grad.t().contiguous().t()
        grads.append(grad)
    grads[0] = None if 0 in missing else grads[0].neg() * 0.0      # -0.0 must survive
    return grads


def bucket_pair(params, world: int, threshold: int, wire_dtype=None
                ) -> list[tuple[Bucket, Bucket]]:
    specs = plan_buckets(params, list(range(len(params))), threshold, world)
    return [(Bucket(s, [params[i] for i in s.params], wire_dtype, native=True),
             Bucket(s, [params[i] for i in s.params], wire_dtype, native=False)) for s in specs]


def drive(bucket: Bucket, grads: list, order: list[int], comm: FakeComm, prescale: float,
          postscale: float) -> list[bool]:
    """One iteration of a bucket as the optimizer drives it; returns the usage flags."""
    for j in order:
        bucket.pack(j, grads[j])
        bucket.pack(j, grads[j])          # a second pack in one iteration is ignored
    bucket.pack_missing()
    assert bucket.full
    bucket.start_reduce_scatter(comm, prescale)
    bucket.finish_reduce_scatter(postscale)
    bucket.start_all_gather(comm)
    return bucket.finish_all_gather()


@needs_native
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("compress", [False, True], ids=["plain", "fp16-wire"])
@pytest.mark.parametrize("threshold", [0, 64, 1 << 20], ids=["per-param", "several", "one"])
def test_bucket_pack_unpack_bit_identical(dtype, world, compress, threshold) -> None:
    params = make_params(dtype)
    wire = torch.float16 if compress and dtype in (torch.float32, torch.float64) else None
    prescale, postscale = (0.5, 1.0 / world) if world > 1 else (1.0, 1.0)
    for step, missing in enumerate([{2}, set(), {0, 4, 6}]):
        grads = make_grads(params, seed=step, missing=missing)
        for p, g in zip(params, grads):      # pack_missing reads .grad (None: zeros, flag 0)
            p.grad = g
        for native_b, python_b in bucket_pair(params, world, threshold, wire):
            assert native_b.ready is not None and python_b.ready is None
            local = [grads[i] for i in native_b.spec.params]
            # Hooks deliver these (last layer first); the last one and the missing ones come
            # in through pack_missing at step().
            order = [j for j in reversed(range(len(local))) if local[j] is not None][:-1]
            comms = FakeComm(world, rank=world - 1), FakeComm(world, rank=world - 1)
            used = [drive(b, local, order, c, prescale, postscale)
                    for b, c in zip((native_b, python_b), comms)]
            assert used[0] == used[1]
            assert used[0] == [g is not None for g in local]
            assert torch.equal(bits(comms[0].sent[0]), bits(comms[1].sent[0])), \
                "different bytes on the wire"
            assert torch.equal(bits(native_b.buffer), bits(python_b.buffer))
            assert torch.equal(bits(native_b.wire), bits(python_b.wire))
            for a, b in zip(native_b.grad_views, python_b.grad_views):
                assert torch.equal(bits(a), bits(b))
            native_b.reset()
            python_b.reset()
            assert not native_b.full and not python_b.full


@needs_native
def test_pack_writes_the_gradient_bytes_flags_and_zero_padding() -> None:
    """Independent of the Python path: the layout written is the documented one."""
    params = make_params(torch.float32)
    grads = make_grads(params, seed=7, missing={3})
    (bucket, _), = bucket_pair(params, 3, 1 << 20)
    bucket.buffer.fill_(float("nan"))                 # stale bytes must all be overwritten
    for j, g in enumerate(grads):
        bucket.pack(j, g)
    assert bucket.buffer.isnan().all(), "backward's hooks must only take references"
    bucket.fill()                                     # the copy, on the issuing thread
    spec = bucket.spec
    for j, (off, n) in enumerate(zip(spec.offsets, spec.numels)):
        expect = torch.zeros(n) if grads[j] is None else grads[j].reshape(-1)
        assert torch.equal(bits(bucket.buffer[off:off + n]), bits(expect))
    flags = bucket.buffer[spec.flags_offset:spec.flags_offset + len(params)]
    assert flags.tolist() == [0.0 if g is None else 1.0 for g in grads]
    assert spec.padded_numel % 3 == 0 and spec.padded_numel > spec.flags_offset + len(params)
    assert bits(bucket.buffer[spec.flags_offset + len(params):]).eq(0).all()


@needs_native
def test_bookkeeping_states() -> None:
    params = make_params(torch.float32)
    (bucket, _), = bucket_pair(params, 2, 1 << 20)
    ready = bucket.ready
    assert ready.size() == len(params) and ready.num_recorded() == 0
    assert not ready.record(2, torch.ones(SHAPES[2]))
    assert ready.recorded(2) and not ready.recorded(1)
    assert ready.missing() == [j for j in range(len(params)) if j != 2]
    assert ready.used()[2] == 1.0 and ready.used()[0] == 0.0
    with pytest.raises(RuntimeError, match="outside this bucket"):
        ready.record(len(params), None)
    with pytest.raises(RuntimeError, match="elements, but the parameter has"):
        ready.record(0, torch.ones(4))
    ready.reset()
    assert ready.num_recorded() == 0 and ready.missing() == list(range(len(params)))


@needs_native
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients_same_behaviour(sparse_as_dense: bool) -> None:
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(4))]
    specs = plan_buckets(params, [0, 1], 1 << 20, 2)
    sparse = torch.sparse_coo_tensor([[1, 3]], torch.ones(2, 3), (5, 3), check_invariants=True)
    outcomes = []
    for use_native in (True, False):
        bucket = Bucket(specs[0], params, None, sparse_as_dense, native=use_native)
        try:
            bucket.pack(0, sparse)
            bucket.pack(1, torch.ones(4))
            bucket.start_reduce_scatter(FakeComm(2), 1.0)
            outcomes.append(bucket.buffer.clone())
        except RuntimeError as exc:
            outcomes.append(str(exc))
    if sparse_as_dense:
        assert torch.equal(outcomes[0], outcomes[1])
    else:
        assert "sparse_as_dense=True" in outcomes[0] and "sparse_as_dense=True" in outcomes[1]


def test_dear_native_knob() -> None:
    assert Config.from_env({}).native is True
    assert Config.from_env({"DEAR_NATIVE": "0"}).native is False
    with pytest.raises(ValueError, match="DEAR_NATIVE"):
        Config.from_env({"DEAR_NATIVE": "maybe"})
    dear.init(backend="local", native=False)
    try:
        params = make_params(torch.float32)
        bucket = Bucket(plan_buckets(params, list(range(len(params))), 1 << 20, 1)[0], params)
        assert bucket.ready is None                  # DEAR_NATIVE=0: the Python path
    finally:
        dear.shutdown()
    dear.init(backend="local")
    try:
        bucket = Bucket(plan_buckets(params, list(range(len(params))), 1 << 20, 1)[0], params)
        assert (bucket.ready is not None) == native.native_available()
    finally:
        dear.shutdown()


def test_extension_is_built_where_a_compiler_exists() -> None:
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler: the pure-Python path is expected")
    assert native.native_available(), (
        f"a C++ compiler exists but dear._native does not load ({native.load_error()}); "
        "install with `pip install --no-build-isolation -e .` (make setup does)")


@pytest.mark.parametrize("use_ext", [True, False], ids=["extension", "fallback"])
def test_standalone_pack_and_unpack(monkeypatch, use_ext: bool) -> None:
    if use_ext and not native.native_available():
        pytest.skip("native extension not built")
    if not use_ext:
        monkeypatch.setattr(native, "_ext", None)
    params = make_params(torch.bfloat16)
    grads = make_grads(params, seed=3, missing={1})
    spec = plan_buckets(params, list(range(len(params))), 1 << 20, 3)[0]
    buffer = torch.full((spec.padded_numel,), float("nan"), dtype=torch.bfloat16)
    used = [g is not None for g in grads]
    native.pack_bucket(buffer, spec.offsets, spec.numels, spec.flags_offset, grads, used)
    outs = [torch.full(p.shape, 7.0, dtype=p.dtype) for p in params]
    native.unpack_into(buffer, spec.offsets, spec.numels, spec.flags_offset, outs)
    for g, out in zip(grads, outs):
        assert torch.equal(bits(out), bits(torch.zeros_like(out) if g is None else g))
    assert buffer[spec.flags_offset:spec.flags_offset + len(params)].tolist() == \
        [float(u) for u in used]
    assert bits(buffer[spec.flags_offset + len(params):]).eq(0).all()


def test_info_reports_native_and_backends() -> None:
    out = subprocess.run([sys.executable, "-m", "dear.info"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "native extension: " in out and "backends:" in out
    assert ("built (C++" in out) == native.native_available()
    info = dear.info.collect() if hasattr(dear, "info") else __import__("dear.info").info.collect()
    assert info["native"]["available"] == native.native_available()
    assert dear.native_available() == native.native_available()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_backend_needs_cuda() -> None:
    from dear.comm import nccl
    assert nccl.availability().startswith("no")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        dear.init(backend="nccl")
    assert not dear.is_initialized()


def test_without_the_extension_dear_falls_back_to_python() -> None:
    """As on a machine where csrc/ did not build: dear imports, reports why, and trains."""
    code = """
import sys
sys.modules["dear._native"] = None          # import of the extension now fails
import torch, dear
from dear import native
assert not dear.native_available() and "dear._native" in native.load_error()
dear.init(backend="local")
model = torch.nn.Linear(4, 2)
opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
model(torch.ones(3, 4)).sum().backward()
opt.step()
opt.synchronize()
assert opt.dear_engine.buckets[0].ready is None
dear.shutdown()
print("fallback ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "fallback ok" in out.stdout, out.stderr
