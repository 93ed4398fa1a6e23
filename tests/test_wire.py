"""What ranks send each other (broadcast_object, all_gather_object) is decoded without pickle:
bytes from another rank or from the rendezvous store can only become plain values, CPU tensors
and dear's own dataclasses and enums (issue 34, exposure). dear/comm/wire.py."""

from __future__ import annotations

import json
import math
import os
import pickle
import struct

import pytest
import torch

from dear.comm import wire
from dear.config import Autotune
from dear.fusion.fusion_config import FusionConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("value", [
    None, True, 0, -2**70, 1.5, float("nan"), float("-inf"), "é", b"\x00\xff", [1, (2, "3")],
    {1: "a", (1, 2): {"k": [None]}}, {1, 2}, frozenset({"x"}),
    torch.arange(6.0).reshape(2, 3), torch.tensor([1.5, -2], dtype=torch.bfloat16),
    torch.empty(0, 4), torch.tensor(3), torch.float16, torch.device("cpu"),
    FusionConfig(1, 2, None, 1024), Autotune.ONLINE,
    {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}},
     "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0], "foreach": None}]},
], ids=repr)
def test_plain_values_travel_unchanged(value: object) -> None:
    assert _same(value, wire.decode(wire.encode(value)))


def test_torch_size_travels_as_an_equal_tuple() -> None:
    assert wire.decode(wire.encode(torch.Size([2, 3]))) == (2, 3)


class _RunsCode:
    def __reduce__(self):                      # what a malicious pickle would carry
        return (os.system, ("echo never",))


def test_what_is_not_plain_is_refused_on_the_sender() -> None:
    for value in (_RunsCode(), object(), torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="cannot send"):
            wire.encode(value)


def _document(value: object) -> bytes:
    doc = json.dumps({"v": value, "tensors": []}).encode()
    return struct.pack("<Q", len(doc)) + doc


@pytest.mark.parametrize("payload", [
    pickle.dumps(_RunsCode()),                                # a pickle planted in the store
    _document({"D": "os:system", "f": {}}),                   # a class outside dear
    _document({"E": "subprocess:Popen", "v": "ls"}),
    _document({"D": "dear.comm.wire:encode", "f": {}}),       # dear's, but not a class
    _document({"dtype": "load"}),                             # torch.load is no dtype
    _document({"D": "dear.nope:X", "f": {}}),
], ids=["pickle", "foreign-dataclass", "foreign-enum", "function", "not-a-dtype", "no-module"])
def test_bytes_that_name_anything_else_are_refused_on_the_receiver(payload: bytes) -> None:
    with pytest.raises(ValueError, match="could not be decoded"):
        wire.decode(payload)


def test_no_communicator_unpickles_what_other_ranks_send() -> None:
    for name in os.listdir(os.path.join(ROOT, "dear", "comm")):
        if name.endswith(".py"):
            with open(os.path.join(ROOT, "dear", "comm", name)) as fh:
                assert "pickle.loads" not in fh.read(), name


def test_the_horovod_data_planes_store_listens_on_the_launch_address_only() -> None:
    """TCPStore alone listens on every interface; dear's is bound to the address it gives the
    other ranks."""
    import datetime

    from dear.comm import gloo_bootstrap
    store = gloo_bootstrap.store_listening_on("127.0.0.1", 2, datetime.timedelta(seconds=5))
    port = f"{store.port:04X}"
    with open("/proc/net/tcp") as fh:
        listening = [line.split()[1] for line in fh.readlines()[1:]
                     if line.split()[1].endswith(":" + port) and line.split()[3] == "0A"]
    assert listening == ["0100007F:" + port], listening
