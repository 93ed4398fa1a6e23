"""fp16 compression really halves the bytes on the wire, in both collectives."""

import pytest
import torch
import torch.nn.functional as F

import dear
from dear.comm.local import LocalCommunicator
from dear.comm.runtime import _state
from tests.workloads import batch, make_net


class Recording(LocalCommunicator):
    def __init__(self):
        self.calls = []

    def reduce_scatter(self, input, output):
        self.calls.append(("rs", input.dtype, input.numel() * input.element_size()))
        return super().reduce_scatter(input, output)

    def all_gather(self, input, output):
        self.calls.append(("ag", output.dtype, output.numel() * output.element_size()))
        return super().all_gather(input, output)


@pytest.mark.parametrize("compression", [dear.Compression.fp16, "hvd-style"])
def test_fp16_halves_wire_bytes(compression):
    if compression == "hvd-style":             # a Horovod compressor class is accepted by name
        compression = type("FP16Compressor", (), {})
    dear.init(backend="local")
    rec = Recording()
    _state.comm = rec
    try:
        sizes = {}
        for comp in (dear.Compression.none, compression):
            rec.calls.clear()
            model = make_net()
            opt = dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                            model=model, compression=comp)
            x, y = batch(0, 1, 0)
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.flush_updates()
            sizes[comp] = rec.calls[:]
        plain, packed = sizes.values()
        assert [c[0] for c in plain] == [c[0] for c in packed] == ["rs", "ag"]
        assert all(c[1] == torch.float32 for c in plain)
        assert all(c[1] == torch.float16 for c in packed)
        assert all(p[2] == 2 * q[2] for p, q in zip(plain, packed))
    finally:
        dear.shutdown()


def test_unknown_compression_is_refused():
    dear.init(backend="local")
    try:
        model = make_net()
        with pytest.raises(TypeError, match="unsupported compression"):
            dear.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                                      compression="zip")
    finally:
        dear.shutdown()
