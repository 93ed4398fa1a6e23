"""Content fingerprints (dear/guards/written.py, csrc/digest.h): what dear compares to see a write
through `.data`, which leaves autograd's version counter alone.

The native digest is checked against the formula csrc/digest.h states, computed here in plain
Python (CRC-32C bit by bit, MurmurHash3's finalizer), so its detection guarantees are the
formula's: every changed element of up to 4 bytes shows, at every position and stream boundary.
"""

from __future__ import annotations

import struct

import pytest
import torch

from dear import native
from dear.guards import written
from dear.guards.written import first_changed, fingerprints

needs_native = pytest.mark.skipif(not native.native_available(),
                                  reason=f"native extension not built: {native.load_error()}")

# Sizes around the three CRC streams' boundaries (24 bytes a round) and the hash's 8 lanes.
SIZES = [1, 2, 3, 5, 6, 7, 8, 11, 12, 13, 24, 25, 47, 49, 97]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.int32]


def _crc32c(crc: int, data: bytes) -> int:
    for byte in data:                     # reflected polynomial 0x82F63B78, no final inversion
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc


def _crc_digest(data: bytes) -> int:
    m = len(data) // 24
    a = _crc32c(0xFFFFFFFF, data[:8 * m])
    b = _crc32c(0x6A09E667, data[8 * m:16 * m])
    c = _crc32c(0xBB67AE85, data[16 * m:])
    c_rotated = ((c << 16) | (c >> 16)) & 0xFFFFFFFF
    return a | ((b ^ c_rotated) << 32)


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _hash_digest(data: bytes) -> int:
    padded = data + bytes(-len(data) % 4)
    words = struct.unpack(f"<{len(padded) // 4}I", padded)
    return sum(_fmix32(w ^ ((i * 0x9E3779B9) & 0xFFFFFFFF)) for i, w in enumerate(words)) \
        % (1 << 64)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _example(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-100, 100, (n,), generator=g, dtype=dtype)
    return torch.randn(n, generator=g).to(dtype)


def _digest(t: torch.Tensor, portable: bool = False) -> int:
    ext = native.extension()
    assert ext is not None
    return ext.digests([t], portable)[0]


@needs_native
@pytest.mark.parametrize("portable", [False, True], ids=["crc32c", "hash"])
def test_digest_is_the_stated_formula(portable: bool) -> None:
    if not portable and not _has_crc_instruction():
        pytest.skip("this CPU has no CRC-32C instruction: the hash is the digest")
    reference = _hash_digest if portable else _crc_digest
    for dtype in DTYPES:
        for n in SIZES:
            t = _example(n, dtype)
            assert _digest(t, portable) == reference(_bytes(t)), (dtype, n)
    assert _digest(torch.empty(0), portable) == reference(b"")


def _has_crc_instruction() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return " sse4_2" in flags or " crc32" in flags


@needs_native
@pytest.mark.parametrize("portable", [False, True], ids=["crc32c", "hash"])
def test_every_single_changed_element_shows(portable: bool) -> None:
    for dtype in DTYPES:
        for n in SIZES:
            t = _example(n, dtype)
            before = _digest(t, portable)
            for k in range(n):
                u = t.clone()
                u[k] = ~u[k] if dtype == torch.bool else (
                    u[k] + 1 if not dtype.is_floating_point else -u[k] if u[k] != 0 else 1)
                assert _digest(u, portable) != before, (dtype, n, k)


@needs_native
def test_edits_the_two_sums_missed_show() -> None:
    """A sign flip of balanced elements and a swap keep both of the fallback's sums."""
    t = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0, 3.0])
    flipped, swapped = t.clone(), t.clone()
    flipped[:4].neg_()
    swapped[4], swapped[5] = t[5], t[4]
    with_native = fingerprints([t, flipped, swapped])
    assert with_native[0] != with_native[1] and with_native[0] != with_native[2]
    assert first_changed([with_native[0]] * 2, with_native[1:]) == 0


@needs_native
def test_layouts() -> None:
    """A dense tensor is read where it lies (channels_last too); any other view as a copy."""
    x = torch.randn(2, 3, 4, 5)
    cl = x.to(memory_format=torch.channels_last)
    assert written.fingerprint(cl) == written.fingerprint(cl.clone(
        memory_format=torch.channels_last))
    strided = x[:, :, ::2]
    assert written.fingerprint(strided) == written.fingerprint(strided.contiguous())
    p = torch.nn.Parameter(torch.randn(6, 4).t())          # no autograd history from a copy
    assert written.fingerprint(p) == written.fingerprint(p.detach().clone())
    cl[0, 1, 2, 3] += 1
    assert written.fingerprint(cl) != written.fingerprint(x.to(memory_format=torch.channels_last))


def test_fallback_sums_and_first_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension (and on a GPU): two sums in tensors, compared in one stack."""
    monkeypatch.setattr(native, "_ext", None)
    ts = [torch.randn(5), torch.arange(4), torch.randn(3).half()]
    before = fingerprints(ts)
    assert all(isinstance(f, tuple) for f in before)
    assert first_changed(before, fingerprints(ts)) is None
    ts[2][1] += 1
    assert first_changed(before, fingerprints(ts)) == 2
    ts[1][0] += 1
    assert first_changed(before, fingerprints(ts)) == 1


def test_first_changed_mixes_digests_and_sums() -> None:
    sums = (torch.tensor(3), torch.tensor(4))
    assert first_changed([7, sums, 9], [7, sums, 9]) is None
    assert first_changed([7, sums, 9], [7, sums, 8]) == 2
    assert first_changed([7, sums, 9], [7, (torch.tensor(3), torch.tensor(5)), 8]) == 1
    assert first_changed([7, sums], [sums, sums]) == 0           # a tensor moved device
    assert first_changed([sums], [(torch.tensor(3),)]) == 0


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@needs_native
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_digest_is_the_stated_formula() -> None:
    """The CUDA kernel computes digest.h's portable hash: every size and dtype, tensors of
    many blocks, and slices that start off a 4-byte boundary, in one call."""
    ext = native.extension()
    assert ext is not None and hasattr(ext, "digests_cuda"), "the extension has no CUDA digest"
    cases = [_example(n, dtype, seed=n).cuda() for dtype in DTYPES for n in SIZES]
    cases += [_example(300_001, torch.float32).cuda(), _example(200_003, torch.int8).cuda()]
    raw = torch.randint(0, 256, (1000,), dtype=torch.uint8).cuda()
    cases += [raw[o:o + n] for o in (1, 2, 3) for n in (1, 5, 13, 996 - o)]
    half = _example(101, torch.float16).cuda()
    cases += [half[1:], half[3:50], torch.empty(0, device="cuda")]
    got = ext.digests_cuda(cases).cpu().tolist()
    want = [_signed(_hash_digest(_bytes(t.cpu()))) for t in cases]
    assert got == want
    assert want[-1] == 0


@needs_native
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fingerprints_see_every_changed_element_and_layouts() -> None:
    x = _example(97, torch.bfloat16).cuda()
    before = fingerprints([x])
    assert isinstance(before[0], tuple) and before[0][0].is_cuda
    for k in range(x.numel()):
        y = x.clone()
        y[k] = -y[k] if y[k] != 0 else 1
        assert first_changed(before, fingerprints([y])) == 0, k
    z = torch.randn(2, 3, 4, 5, device="cuda")
    cl = z.to(memory_format=torch.channels_last)
    assert first_changed(fingerprints([cl]), fingerprints([cl.clone(
        memory_format=torch.channels_last)])) is None
    strided = z[:, :, ::2]
    assert first_changed(fingerprints([strided]), fingerprints([strided.contiguous()])) is None
    p = torch.nn.Parameter(torch.randn(6, 4, device="cuda").t())
    assert first_changed(fingerprints([p]), fingerprints([p.detach().clone()])) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_beside_cpu_tensors() -> None:
    ts = [torch.randn(1000, device="cuda"), torch.randn(7, device="cuda").half(), torch.randn(5)]
    before = fingerprints(ts)
    assert first_changed(before, fingerprints(ts)) is None
    ts[1][3] += 1
    assert first_changed(before, fingerprints(ts)) == 1
    ts[0][998:].neg_()
    assert first_changed(before[:1], fingerprints(ts[:1])) == 0
    ts[2][0] += 1                               # the CPU tensor beside them: its own digest
    assert first_changed(before[2:], fingerprints(ts[2:])) == 0
