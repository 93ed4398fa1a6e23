"""Objects sent between ranks (broadcast_object, all_gather_object) as plain data, never pickle.

What dear exchanges is plain: settings, parameter orders, layouts and plans (dear's own
dataclasses), optimizer state dicts (numbers and tensors). Unpickling bytes that came from
another rank or from the rendezvous store (keys any host reaching MASTER_PORT can write) would
run whatever code they name; decoding this format can only build the values below:

  None, bool, int, float (nan and inf included), str, bytes, list, tuple, set, frozenset,
  dict (any of these as keys), torch.Tensor (CPU, its dtype, shape and bytes), torch.dtype,
  torch.device, and dataclasses and enums defined in dear's own modules (by name, their fields
  set from decoded values; no constructor or other code of theirs runs).

Anything else is refused on the sending rank with the type named. Layout: an 8-byte length, the
JSON document, then the tensors' bytes. torch's own all_gather_object / broadcast_object_list
(NCCL groups) carry the encoded bytes, so what they unpickle is a bytes object.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
import struct
from typing import Any

import torch

_OWN = "dear."


def encode(obj: Any) -> bytes:
    blobs: list[bytes] = []
    tensors: list[dict[str, Any]] = []
    doc = json.dumps({"v": _pack(obj, blobs, tensors), "tensors": tensors},
                     allow_nan=True, separators=(",", ":")).encode()
    return struct.pack("<Q", len(doc)) + doc + b"".join(blobs)


def decode(data: bytes) -> Any:
    try:
        (length,) = struct.unpack_from("<Q", data, 0)
        doc = json.loads(data[8:8 + length].decode())
        body = memoryview(data)[8 + length:]
        tensors, offset = [], 0
        for meta in doc["tensors"]:
            nbytes = int(meta["nbytes"])
            if offset + nbytes > len(body):
                raise ValueError("a tensor's bytes are missing")
            tensors.append(_tensor(meta, body[offset:offset + nbytes]))
            offset += nbytes
        return _unpack(doc["v"], tensors)
    except (ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError,
            ImportError, AttributeError) as exc:
        raise ValueError(f"dear: a message from another rank could not be decoded ({exc!r}): "
                         "every rank must run the same dear version") from None


def _pack(obj: Any, blobs: list[bytes], tensors: list[dict[str, Any]]) -> Any:
    if isinstance(obj, enum.Enum):             # before int/str: IntEnum, str-mixin enums
        return {"E": _name(type(obj)), "v": _pack(obj.value, blobs, tensors)}
    if obj is None or isinstance(obj, (bool, str, int)):
        return obj
    if isinstance(obj, float):
        return {"f": repr(obj)}                # exact, nan and inf included
    if isinstance(obj, bytes):
        return {"b": base64.b64encode(obj).decode()}
    if isinstance(obj, list):
        return [_pack(x, blobs, tensors) for x in obj]
    if isinstance(obj, tuple):                 # torch.Size too
        return {"t": [_pack(x, blobs, tensors) for x in obj]}
    if isinstance(obj, (set, frozenset)):
        return {"fs" if isinstance(obj, frozenset) else "s":
                [_pack(x, blobs, tensors) for x in obj]}
    if isinstance(obj, dict):
        return {"d": [[_pack(k, blobs, tensors), _pack(v, blobs, tensors)]
                      for k, v in obj.items()]}
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.device.type != "cpu":
            raise TypeError(f"dear sends tensors between ranks from the CPU, got one on {t.device}")
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        tensors.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                        "nbytes": len(raw), "grad": bool(obj.requires_grad)})
        blobs.append(raw)
        return {"T": len(tensors) - 1}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"D": _name(type(obj)), "f": {f.name: _pack(getattr(obj, f.name), blobs, tensors)
                                             for f in dataclasses.fields(obj)}}
    raise TypeError(f"dear cannot send a {type(obj).__module__}.{type(obj).__qualname__} to "
                    "other ranks: only plain values, CPU tensors and dear's own dataclasses "
                    "travel (dear/comm/wire.py)")


def _unpack(value: Any, tensors: list[torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, list):
        return [_unpack(x, tensors) for x in value]
    if not isinstance(value, dict) or len(value) not in (1, 2):
        raise ValueError(f"unexpected {type(value).__name__}")
    (tag, payload), *rest = value.items()
    if tag == "f":
        return float(payload)
    if tag == "b":
        return base64.b64decode(payload)
    if tag == "t":
        return tuple(_unpack(x, tensors) for x in payload)
    if tag in ("s", "fs"):
        items = [_unpack(x, tensors) for x in payload]
        return set(items) if tag == "s" else frozenset(items)
    if tag == "d":
        return {_unpack(k, tensors): _unpack(v, tensors) for k, v in payload}
    if tag == "T":
        return tensors[payload]
    if tag == "dtype":
        return _dtype(payload)
    if tag == "device":
        return torch.device(payload)
    if tag == "E":
        cls = _own_class(payload)
        if not issubclass(cls, enum.Enum):
            raise ValueError(f"{payload} is not an enum")
        return cls(_unpack(rest[0][1], tensors))
    if tag == "D":
        cls = _own_class(payload)
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"{payload} is not a dataclass")
        names = {f.name for f in dataclasses.fields(cls)}
        fields = rest[0][1]
        if set(fields) != names:
            raise ValueError(f"{payload}: fields {sorted(fields)} are not {sorted(names)}")
        obj = object.__new__(cls)
        for name, v in fields.items():
            object.__setattr__(obj, name, _unpack(v, tensors))
        return obj
    raise ValueError(f"unknown tag {tag!r}")


def _name(cls: type) -> str:
    if not cls.__module__.startswith(_OWN):
        raise TypeError(f"dear cannot send a {cls.__module__}.{cls.__qualname__} to other ranks: "
                        "only dear's own dataclasses and enums travel (dear/comm/wire.py)")
    return f"{cls.__module__}:{cls.__qualname__}"


def _own_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_OWN) or not qualname:
        raise ValueError(f"{name!r} is not one of dear's classes")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ValueError(f"{name!r} is not a class")
    return obj


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def _tensor(meta: dict[str, Any], raw: memoryview) -> torch.Tensor:
    dtype = _dtype(meta["dtype"])
    shape = [int(n) for n in meta["shape"]]
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if len(raw) else \
        torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape) if flat.numel() else torch.empty(shape, dtype=dtype)
    return t.requires_grad_(bool(meta.get("grad", False))) if t.is_floating_point() else t
