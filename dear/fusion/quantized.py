"""A bucket whose reduce-scatter and all-gather carry block-quantized gradients (int8, int4).

    pack -> (+ residual) quantize each rank's chunk -> all-to-all -> dequantize and sum in fp32
         -> scale -> quantize the averaged shard -> all-gather -> dequantize -> update

Each value is quantized once per hop, as ZeRO++'s qgZ does: a ring reduce-scatter would
quantize partial sums again at every step, so its error would grow with the ranks. Instead
chunk r of every rank goes straight to rank r (Communicator.all_to_all), which sums the
dequantized chunks and its own chunk, unquantized, in rank order. Its averaged shard is
quantized once more for the all-gather, and every rank, the owner included, takes the
dequantized values, so all ranks apply the same gradient bit for bit.

Error feedback (dear/fusion/quantize.py): `residual` holds, per element of this rank's buffer,
what quantization dropped: for the chunks it sent, their rounding; for its own chunk, the
all-gather's rounding of the average, in the sum's units. Both are added to the next
iteration's gradient, so the average the ranks apply over time is the fp32 one.

The usage flags and the padding after them travel as fp32, unquantized: a flag must stay
exactly zero or not. Only fp32 buckets are quantized (dear/fusion/layout.py). Each chunk's
message is a fixed-size slot of bytes: the codes, the block scales (fp32), the raw tail.

With shard_optimizer_state (`sharded`), the all-gather carries this rank's updated parameters,
which must not be rounded: it goes in fp32 through the bucket's own buffer, as an uncompressed
bucket's does, and only the reduce-scatter is quantized. Our own chunk is then never rounded,
so its residual stays zero.

In a planned schedule the all-gather is cut into chunks like any bucket's, in backward's idle
link time: the chunks are byte ranges of the slot, quantized whole when the first is sent
(after the reduce-scatter, with the same averaged values, so the same bits as at step()), and
decoded once the last one has landed.

On CPU the dequantizing runs on one decode thread per process as soon as a collective lands
(the sum during backward, the unpack before the next forward), not on the training thread at
step() or in the pre-forward wait; on a GPU it queues on the stream where the wait happens.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from ..comm import runtime
from ..comm.base import CallbackWork, Communicator, Work
from ..comm.compression import QuantizedCompressor
from ..comm.torch_dist import StepThread
from .bucket import Bucket
from .planner import BucketSpec
from .quantize import code_bytes, dequantize, num_blocks, quantize

_decoder: Optional[StepThread] = None


def _decoding() -> StepThread:
    """The process's decode thread: on CPU, what an all-to-all or all-gather received is
    dequantized there as soon as it lands (the kernels release the GIL), so step() and the next
    forward find it done instead of decoding every bucket on the training thread."""
    global _decoder
    if _decoder is None:
        _decoder = StepThread("dear-decode", sticky=False)
        runtime.at_shutdown(_close_decoder)
    return _decoder


def _close_decoder() -> None:
    global _decoder
    decoder, _decoder = _decoder, None
    if decoder is not None:
        decoder.close()


def _then(work: Work, decode: Callable[[], None]) -> Work:
    """`work`, then `decode` on the decode thread (CPU); the Work returned covers both."""
    def run() -> None:
        work.wait()
        decode()
    return _decoding().submit(run)


class _Slot:
    """Typed views of one chunk's message in a byte buffer: codes, scales, raw fp32 tail."""

    def __init__(self, raw_bytes: torch.Tensor, quantized: int, tail: int,
                 codec: QuantizedCompressor) -> None:
        codes = code_bytes(quantized, codec.bits)
        at = -(-codes // 4) * 4
        blocks = num_blocks(quantized, codec.block_size)
        self.codes = raw_bytes[:codes]
        if codec.bits == 8:
            self.codes = self.codes.view(torch.int8)
        self.scales = raw_bytes[at:at + 4 * blocks].view(torch.float32)
        self.raw = raw_bytes[at + 4 * blocks:at + 4 * (blocks + tail)].view(torch.float32)

    @staticmethod
    def nbytes(quantized: int, tail: int, codec: QuantizedCompressor) -> int:
        codes = -(-code_bytes(quantized, codec.bits) // 4) * 4
        return codes + 4 * (num_blocks(quantized, codec.block_size) + tail)


def _slots(buf: torch.Tensor, quantized: Sequence[int], width: int, slot: int,
           codec: QuantizedCompressor) -> list[_Slot]:
    """Slot c of `buf` holds a chunk of `quantized[c]` quantized elements and a raw tail."""
    return [_Slot(buf[c * slot:(c + 1) * slot], q, width - q, codec)
            for c, q in enumerate(quantized)]


def _timed(bucket: QuantizedBucket, phase: str,
           decode: Callable[[], None]) -> Callable[[], None]:
    """`decode` on the decode thread, its time added to `bucket.decode_time[phase]`."""
    def run() -> None:
        start = time.perf_counter()
        decode()
        totals = bucket.decode_time[phase]
        totals[0] += time.perf_counter() - start
        totals[1] += bucket.buffer.numel() * bucket.buffer.element_size()
    return run


class _GatherSide:
    """What a quantized bucket's all-gather carries and how it lands, chosen once per bucket;
    the reduce side (QuantizedBucket) is the same for both. `wire` and `wire_shard` are the
    bucket's: what the all-gather receives into and sends."""

    wire: torch.Tensor
    wire_shard: torch.Tensor

    def own_residual_added(self, residual: torch.Tensor) -> None:
        """Our own chunk just took its residual (it is summed unquantized)."""
        raise NotImplementedError

    def outgoing(self, bucket: QuantizedBucket) -> torch.Tensor:
        """What this rank sends in the all-gather (QuantizedBucket.outgoing_shard)."""
        raise NotImplementedError

    def columns(self, bucket: QuantizedBucket, comm: Communicator, start: int,
                length: int) -> Work:
        """One chunk of the all-gather, columns [start, start + length) of `wire_shard`."""
        raise NotImplementedError

    def start(self, bucket: QuantizedBucket, comm: Communicator) -> None:
        """The whole all-gather."""
        raise NotImplementedError

    def gathering(self, bucket: QuantizedBucket, work: Optional[Work]) -> None:
        """Bucket.gathering: the update is pending once `work` (and earlier chunks) land."""
        raise NotImplementedError

    def land(self, bucket: QuantizedBucket) -> list[bool]:
        """Bucket.land: the gathered values into the buffer; which parameters had a gradient."""
        raise NotImplementedError

    def reset(self) -> None:
        """A dropped step: forget what this iteration's all-gather did so far."""


class _QuantizedGather(_GatherSide):
    """The averaged shard quantized once more into this rank's slot, every rank's slot
    dequantized into the buffer by every rank, the owner included, so all ranks apply the same
    gradient bit for bit. The rounding of our own chunk, in the sum's units, is its residual."""

    def __init__(self, codec: QuantizedCompressor, quantized: Sequence[int], width: int,
                 slot: int, rank: int, device: torch.device,
                 shard: tuple[torch.Tensor, torch.Tensor], residual: Optional[torch.Tensor],
                 grads: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.codec = codec
        self.wire = torch.empty(len(quantized) * slot, dtype=torch.uint8, device=device)
        self.wire_shard = torch.empty(slot, dtype=torch.uint8, device=device)
        self._slots = _slots(self.wire, quantized, width, slot, codec)
        self._own = _Slot(self.wire_shard, quantized[rank], width - quantized[rank], codec)
        self._shard, self._residual, self._grads = shard, residual, list(grads)
        self._gathered = False               # the decode thread unpacked the all-gather
        self._chunked = False                # chunks of the all-gather went out in backward

    def own_residual_added(self, residual: torch.Tensor) -> None:
        """Nothing: the all-gather's rounding of the average refills it (`outgoing`)."""

    def outgoing(self, bucket: QuantizedBucket) -> torch.Tensor:
        """Our averaged shard quantized into our slot; its rounding, in the sum's units, is our
        own chunk's residual for the next iteration."""
        values, tail = self._shard
        residual = self._residual
        if residual is not None:
            residual.zero_()
        quantize(values, residual, self._own.codes, self._own.scales, self.codec.block_size,
                 self.codec.bits)
        if residual is not None and bucket.postscale != 1.0:
            residual.div_(bucket.postscale)
        self._own.raw.copy_(tail)
        return self.wire_shard

    def columns(self, bucket: QuantizedBucket, comm: Communicator, start: int,
                length: int) -> Work:
        """Bytes [start, start + length) of our slot; the first chunk quantizes the whole
        averaged shard."""
        if start == 0:
            self.outgoing(bucket)
        self._chunked = True
        return comm.all_gather_columns(self.wire_shard, self.wire, start, length)

    def start(self, bucket: QuantizedBucket, comm: Communicator) -> None:
        work = comm.all_gather(self.outgoing(bucket), self.wire)
        if self.wire.is_cuda:
            bucket.gathering(work)
            return
        self._gathered = True                # decoded on the decode thread when it lands
        bucket.gathering(_then(work, _timed(bucket, "gather", self._unpack)))

    def gathering(self, bucket: QuantizedBucket, work: Optional[Work]) -> None:
        """As a bucket's; after chunks (on CPU): decoded on the decode thread once every chunk
        has landed, so the next forward finds the values ready."""
        chunked, self._chunked = self._chunked, False
        if not chunked or self.wire.is_cuda:
            Bucket.gathering(bucket, work)
            return
        chunks = bucket.take_gathers() + ([work] if work is not None else [])
        self._gathered = True
        Bucket.gathering(bucket, _then(CallbackWork(chunks), _timed(bucket, "gather",
                                                                    self._unpack)))

    def _unpack(self) -> None:
        """Every rank's slot dequantized into the buffer (our own too: every rank applies the
        same values)."""
        block, bits = self.codec.block_size, self.codec.bits
        for got, (values, tail) in zip(self._slots, self._grads):
            dequantize(got.codes, got.scales, values, block, bits, accumulate=False)
            tail.copy_(got.raw)

    def land(self, bucket: QuantizedBucket) -> list[bool]:
        if not self._gathered:               # a fused group's all-gather, or on a GPU
            self._unpack()
        self._gathered = False
        if bucket.all_used_here:
            return [True] * len(bucket.params)
        return (bucket.flags != 0).tolist()

    def reset(self) -> None:
        self._gathered = self._chunked = False


class _ParameterGather(_GatherSide):
    """shard_optimizer_state: the all-gather carries this rank's updated parameters, which must
    not be rounded: fp32 through the bucket's own buffer and shard, Bucket's plain path. Our
    own chunk is then never rounded, so its residual stays zero."""

    def __init__(self, buffer: torch.Tensor, shard: torch.Tensor) -> None:
        self.wire, self.wire_shard = buffer, shard

    def own_residual_added(self, residual: torch.Tensor) -> None:
        """Spent: no all-gather rounding refills it."""
        residual.zero_()

    def outgoing(self, bucket: QuantizedBucket) -> torch.Tensor:
        assert bucket.outgoing is not None, "a sharded bucket gathers its updated parameters"
        return bucket.outgoing

    def columns(self, bucket: QuantizedBucket, comm: Communicator, start: int,
                length: int) -> Work:
        return Bucket.gather_columns(bucket, comm, start, length)

    def start(self, bucket: QuantizedBucket, comm: Communicator) -> None:
        Bucket.start_all_gather(bucket, comm)

    def gathering(self, bucket: QuantizedBucket, work: Optional[Work]) -> None:
        Bucket.gathering(bucket, work)

    def land(self, bucket: QuantizedBucket) -> list[bool]:
        return Bucket.land(bucket)


class QuantizedBucket(Bucket):
    """A bucket whose reduce-scatter is a block-quantized all-to-all with error feedback; its
    all-gather side (`_GatherSide`) carries the average quantized once more or, `sharded`, the
    updated parameters in fp32."""

    def __init__(self, spec: BucketSpec, params: Sequence[torch.nn.Parameter],
                 codec: QuantizedCompressor, rank: int, sparse_as_dense: bool = False,
                 native: Optional[bool] = None, views: bool = False,
                 sharded: bool = False) -> None:
        super().__init__(spec, params, None, sparse_as_dense, native, views)
        assert spec.dtype == torch.float32
        assert not (sharded and views), "sharded buckets carry parameters back, not views"
        n, width = spec.world_size, spec.shard_numel
        self.codec, self.rank, self.sharded = codec, rank, sharded
        # Chunk c: its first `quantized[c]` elements are gradients, the rest flags or padding.
        self.quantized = [min(max(spec.flags_offset - c * width, 0), width) for c in range(n)]
        slot = max(_Slot.nbytes(q, width - q, codec) for q in self.quantized)
        self.slot_bytes = slot
        dev = spec.device
        self.send = torch.empty(n * slot, dtype=torch.uint8, device=dev)
        self.recv = torch.empty(n * slot, dtype=torch.uint8, device=dev)
        self.residual = (torch.zeros(spec.padded_numel, dtype=torch.float32, device=dev)
                         if codec.error_feedback else None)
        self._send = _slots(self.send, self.quantized, width, slot, codec)
        mine = self.quantized[rank]
        self._recv = _slots(self.recv, [mine] * n, width, slot, codec)   # every rank's for us
        chunks = self.buffer.view(n, width)
        self._grads = [(chunks[c, :q], chunks[c, q:]) for c, q in enumerate(self.quantized)]
        self._shard = (self.shard[:mine], self.shard[mine:])
        self._residuals: list[Optional[torch.Tensor]] = [None] * n
        if self.residual is not None:
            res = self.residual.view(n, width)
            self._residuals = [res[c, :q] for c, q in enumerate(self.quantized)]
        self._gather: _GatherSide = (
            _ParameterGather(self.buffer, self.shard) if sharded else
            _QuantizedGather(codec, self.quantized, width, slot, rank, dev, self._shard,
                             self._residuals[rank], self._grads))
        self.wire, self.wire_shard = self._gather.wire, self._gather.wire_shard
        # What finish_reduce_scatter scaled the sum by: our own chunk's residual is kept in
        # the sum's units.
        self.postscale = 1.0
        # Seconds and buffer bytes the decode thread spent after each transfer, per phase
        # ("reduce": the sum, "gather": the unpack): dear.diagnose's tracer reads them, and
        # its replay adds that time after the collective (dear/diagnose/engine.py's `post`).
        self.decode_time: dict[str, list[float]] = {"reduce": [0.0, 0.0], "gather": [0.0, 0.0]}
        self._summed = False                 # the decode thread summed the shard

    @property
    def reduce_bytes(self) -> int:
        return self.send.numel()

    @property
    def wires(self) -> tuple[torch.Tensor, ...]:
        return (self.wire, self.wire_shard, self.send, self.recv)

    # ------------------------------------------------------------------ reduce side
    def _reduce(self, comm: Communicator) -> Work:
        """Quantize every other rank's chunk (its residual added and renewed), add our own
        residual to our own chunk (summed unquantized), and send the slots."""
        block, bits = self.codec.block_size, self.codec.bits
        for c, ((values, tail), residual) in enumerate(zip(self._grads, self._residuals)):
            if c == self.rank:
                if residual is not None:
                    values.add_(residual)
                    self._gather.own_residual_added(residual)
                continue
            out = self._send[c]
            quantize(values, residual, out.codes, out.scales, block, bits)
            out.raw.copy_(tail)
        work = comm.all_to_all(self.send, self.recv)
        self._summed = not self.send.is_cuda
        return _then(work, _timed(self, "reduce", self._sum)) if self._summed else work

    def _sum(self) -> None:
        """Our shard: every rank's chunk in rank order (our own unquantized), not yet scaled.
        The first term is copied (0 + a = a: the same bits as summing from zero)."""
        values, tail = self._shard
        own_values, own_tail = self._grads[self.rank]
        block, bits = self.codec.block_size, self.codec.bits
        for c, got in enumerate(self._recv):
            if c == self.rank:
                (values.copy_ if c == 0 else values.add_)(own_values)
                (tail.copy_ if c == 0 else tail.add_)(own_tail)
            else:
                dequantize(got.codes, got.scales, values, block, bits, accumulate=c > 0)
                (tail.copy_ if c == 0 else tail.add_)(got.raw)

    def _sum_into_shard(self, postscale: float) -> None:
        if not self._summed:                 # on a GPU: its kernels queue on the stream now
            self._sum()
        self.postscale = postscale

    # ------------------------------------------------------------------ gather side
    def outgoing_shard(self) -> torch.Tensor:
        return self._gather.outgoing(self)

    def gather_columns(self, comm: Communicator, start: int, length: int) -> Work:
        return self._gather.columns(self, comm, start, length)

    def start_all_gather(self, comm: Communicator) -> None:
        self._gather.start(self, comm)

    def gathering(self, work: Optional[Work] = None) -> None:
        self._gather.gathering(self, work)

    def land(self) -> list[bool]:
        return self._gather.land(self)

    def drop(self) -> None:
        """A skipped or refused step: its gradient is discarded, and with it what quantizing
        it left over (the residuals were renewed at issue; our own chunk's was consumed)."""
        try:
            super().drop()
        finally:
            self._gather.reset()
            if self.residual is not None:
                self.residual.zero_()

    # -------------------------------------------------------- residuals across layouts
    def residual_of(self, j: int) -> Optional[torch.Tensor]:
        """Parameter j's residual, a view (None without error feedback)."""
        if self.residual is None:
            return None
        o, n = self.spec.offsets[j], self.spec.numels[j]
        return self.residual[o:o + n]
