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


class QuantizedBucket(Bucket):
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
        if not sharded:                          # else the base class's: buffer and shard
            self.wire = torch.empty(n * slot, dtype=torch.uint8, device=dev)
            self.wire_shard = torch.empty(slot, dtype=torch.uint8, device=dev)
        self.residual = (torch.zeros(spec.padded_numel, dtype=torch.float32, device=dev)
                         if codec.error_feedback else None)

        def slots(buf: torch.Tensor, chunk: Optional[int] = None) -> list[_Slot]:
            """Slot c holds chunk c (or, what every rank sends us, our `chunk`)."""
            q = [self.quantized[c if chunk is None else chunk] for c in range(n)]
            return [_Slot(buf[c * slot:(c + 1) * slot], q[c], width - q[c], codec)
                    for c in range(n)]
        self._send = slots(self.send)
        self._recv = slots(self.recv, chunk=rank)
        mine = self.quantized[rank]
        if not sharded:
            self._wire = slots(self.wire)
            self._own = _Slot(self.wire_shard, mine, width - mine, codec)
        chunks = self.buffer.view(n, width)
        self._grads = [(chunks[c, :q], chunks[c, q:]) for c, q in enumerate(self.quantized)]
        self._shard = (self.shard[:mine], self.shard[mine:])
        self._residuals: list[Optional[torch.Tensor]] = [None] * n
        if self.residual is not None:
            res = self.residual.view(n, width)
            self._residuals = [res[c, :q] for c, q in enumerate(self.quantized)]
        self._postscale = 1.0
        # Seconds and buffer bytes the decode thread spent after each transfer, per phase
        # ("reduce": the sum, "gather": the unpack): dear.diagnose's tracer reads them, and
        # its replay adds that time after the collective (dear/diagnose/engine.py's `post`).
        self.decode_time: dict[str, list[float]] = {"reduce": [0.0, 0.0], "gather": [0.0, 0.0]}
        self._summed = False                 # the decode thread summed the shard
        self._gathered = False               # ... and unpacked the all-gather
        self._chunked = False                # chunks of the all-gather went out in backward

    @property
    def reduce_bytes(self) -> int:
        return self.send.numel()

    @property
    def wires(self) -> tuple[torch.Tensor, ...]:
        return (self.wire, self.wire_shard, self.send, self.recv)

    def _reduce(self, comm: Communicator) -> Work:
        """Quantize every other rank's chunk (its residual added and renewed), add our own
        residual to our own chunk (summed unquantized), and send the slots."""
        block, bits = self.codec.block_size, self.codec.bits
        for c, ((values, tail), residual) in enumerate(zip(self._grads, self._residuals)):
            if c == self.rank:
                if residual is not None:
                    values.add_(residual)
                    if self.sharded:             # no all-gather rounding refills it
                        residual.zero_()
                continue
            out = self._send[c]
            quantize(values, residual, out.codes, out.scales, block, bits)
            out.raw.copy_(tail)
        work = comm.all_to_all(self.send, self.recv)
        self._summed = not self.send.is_cuda
        return _then(work, self._timed("reduce", self._sum)) if self._summed else work

    def _timed(self, phase: str, decode: Callable[[], None]) -> Callable[[], None]:
        """`decode` on the decode thread, its time added to `decode_time[phase]`."""
        def run() -> None:
            start = time.perf_counter()
            decode()
            totals = self.decode_time[phase]
            totals[0] += time.perf_counter() - start
            totals[1] += self.buffer.numel() * self.buffer.element_size()
        return run

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
        self._postscale = postscale

    def outgoing_shard(self) -> torch.Tensor:
        """Our averaged shard quantized into our slot; its rounding, in the sum's units, is our
        own chunk's residual for the next iteration. Sharded: our updated parameters, fp32."""
        if self.sharded:
            assert self.outgoing is not None, "a sharded bucket gathers its updated parameters"
            return self.outgoing
        values, tail = self._shard
        residual = self._residuals[self.rank]
        if residual is not None:
            residual.zero_()
        quantize(values, residual, self._own.codes, self._own.scales, self.codec.block_size,
                 self.codec.bits)
        if residual is not None and self._postscale != 1.0:
            residual.div_(self._postscale)
        self._own.raw.copy_(tail)
        return self.wire_shard

    def gather_columns(self, comm: Communicator, start: int, length: int) -> Work:
        """Bytes [start, start + length) of our slot (sharded: fp32 columns of the updated
        parameters); the first chunk quantizes the whole averaged shard."""
        if self.sharded:
            return super().gather_columns(comm, start, length)
        if start == 0:
            self.outgoing_shard()
        self._chunked = True
        return comm.all_gather_columns(self.wire_shard, self.wire, start, length)

    def start_all_gather(self, comm: Communicator) -> None:
        if self.sharded:
            super().start_all_gather(comm)
            return
        work = comm.all_gather(self.outgoing_shard(), self.wire)
        if self.wire.is_cuda:
            self.gathering(work)
            return
        self._gathered = True                # decoded on the decode thread when it lands
        self.gathering(_then(work, self._timed("gather", self._unpack)))

    def gathering(self, work: Optional[Work] = None) -> None:
        """As a bucket's; after chunks (on CPU): decoded on the decode thread once every chunk
        has landed, so the next forward finds the values ready."""
        chunked, self._chunked = self._chunked, False
        if not chunked or self.wire.is_cuda:
            super().gathering(work)
            return
        chunks = self._gathers + ([work] if work is not None else [])
        self._gathers, self._gathered = [], True
        super().gathering(_then(CallbackWork(chunks), self._timed("gather", self._unpack)))

    def _unpack(self) -> None:
        """Every rank's slot dequantized into the buffer (our own too: every rank applies the
        same values)."""
        block, bits = self.codec.block_size, self.codec.bits
        for got, (values, tail) in zip(self._wire, self._grads):
            dequantize(got.codes, got.scales, values, block, bits, accumulate=False)
            tail.copy_(got.raw)

    def _land(self) -> list[bool]:
        if self.sharded:
            return super()._land()
        if not self._gathered:               # a fused group's all-gather, or on a GPU
            self._unpack()
        self._gathered = False
        if self._all_used_here:
            return [True] * len(self.params)
        return (self.flags != 0).tolist()

    def drop(self) -> None:
        """A skipped or refused step: its gradient is discarded, and with it what quantizing
        it left over (the residuals were renewed at issue; our own chunk's was consumed)."""
        try:
            super().drop()
        finally:
            self._gathered = self._chunked = False
            if self.residual is not None:
                self.residual.zero_()

    # -------------------------------------------------------- residuals across layouts
    def residual_of(self, j: int) -> Optional[torch.Tensor]:
        """Parameter j's residual, a view (None without error feedback)."""
        if self.residual is None:
            return None
        o, n = self.spec.offsets[j], self.spec.numels[j]
        return self.residual[o:o + n]
