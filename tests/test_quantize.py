"""Block-wise int8/int4 quantization with error feedback: the native kernels (csrc/quantize.cpp,
dear._native.quantize_blocks / dequantize_blocks) against dear/fusion/quantize.py's plain-torch
reference, bit for bit, and both against the definition written out in numpy with no code of
dear's (tests/quantize_closed_form.py: scale = max|y| / qmax per block, round half to even).

Bit for bit means: codes equal (torch.equal), scales and residuals equal as int32 (so a NaN scale
equals a NaN scale, and +0.0 differs from -0.0), for bits 8 and 4, block sizes 1, 7, 64 and 256,
lengths 0, 1, block - 1, block, block + 1, odd ones and 100003 (several threads), inputs of
several magnitudes, zero blocks, -0.0, blocks holding inf, -inf or NaN, subnormals (also a block
so small that max|y| / qmax underflows to a scale of 0), with and without a residual, the
residual carried across calls, and tensors that are views at an offset of larger ones.

The error-feedback identity (checked on the reference too, which needs no extension): for every
value of a block with a finite maximum, dequantized + new residual = x + old residual to within
the one fp32 rounding of y = x + old residual:

    |(float(q) * scale + residual_new) - (x + residual_old)| <= ulp(max(|x|, |residual_old|))

(both sides summed exactly in float64; ulp: the fp32 spacing at that value; the codes decoded
and dequantized by the numpy closed form, not by dear). It holds exactly
after that rounding: y - float(q) * scale is exact (Sterbenz: float(q) * scale is within a
factor 2 of y, or 0), so dequantized + new residual is y itself. A block that is not finite
sends scale NaN, codes 0, and keeps residual 0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dear import native
from dear.fusion import quantize as Q
from tests import quantize_closed_form as CF

_ext = native.extension()
_missing = (f"native extension not built ({native.load_error()})" if _ext is None else
            "the native extension has no quantize_blocks (rebuild: python setup.py build_ext "
            "--inplace)" if not hasattr(_ext, "quantize_blocks") else None)
needs_native = pytest.mark.skipif(_missing is not None, reason=_missing or "")

BITS = [8, 4]
BLOCKS = [1, 7, 64, 256]
KINDS = ["small", "unit", "large", "zeros", "special"]
MAGNITUDE = {"small": 1e-8, "unit": 1.0, "large": 1e4, "zeros": 0.0, "special": 1.0}
TINY = 2.0 ** -149           # the least fp32 subnormal
FEATURES = 9                 # kinds of block in "special" inputs (see make_input)


def lengths(block: int) -> list[int]:
    return sorted({0, 1, block - 1, block, block + 1, 2 * block + 3, 7 * block + 5, 101,
                   100003})


def code_tensor(n: int, bits: int, device: str = "cpu") -> torch.Tensor:
    """Codes for n values, filled with a pattern the kernels must overwrite everywhere."""
    return torch.full((Q.code_bytes(n, bits),), 0x55,
                      dtype=torch.int8 if bits == 8 else torch.uint8, device=device)


def scale_tensor(n: int, block: int, device: str = "cpu") -> torch.Tensor:
    return torch.full((Q.num_blocks(n, block),), 12345.0, device=device)


def make_input(kind: str, n: int, block: int, seed: int, residual: bool, bits: int
               ) -> tuple[torch.Tensor, "torch.Tensor | None"]:
    """x and a residual (or None). "special": block b is of kind (b + seed) % FEATURES: 0 normal,
    1 all zeros (some -0.0), 2 zeros, -0.0 and one normal value, 3 one +inf, 4 one -inf, 5 one
    NaN, 6 subnormals with a subnormal scale, 7 subnormals of at most 3 least subnormals (the
    scale underflows to 0 for both qmax), 8 exact ties: y / scale = k + 0.5, both signs.
    Every kind has -0.0 values, where the residual is -0.0 too, so that y is -0.0 there."""
    g = torch.Generator().manual_seed(seed * 7919 + n)
    mag = MAGNITUDE[kind]
    x = torch.randn(n, generator=g) * mag
    r = torch.randn(n, generator=g) * (mag * 0.01) if residual else None
    negzero = torch.rand(n, generator=g) < 0.05
    if kind == "special" and n:
        nb = Q.num_blocks(n, block)
        idx = torch.arange(n)
        blk = idx // block
        size = torch.full((nb,), block)
        size[-1] = n - (nb - 1) * block
        one = idx % block == (torch.rand(nb, generator=g) * size).long()[blk]  # one a block
        feature = (blk + seed) % FEATURES
        f = [feature == k for k in range(FEATURES)]
        x[f[1] | f[2]] = 0.0
        x[f[2] & one] = 3.5
        x[f[3] & one] = float("inf")
        x[f[4] & one] = float("-inf")
        x[f[5] & one] = float("nan")
        x[f[6]] *= 1e-39
        x[f[7]] = torch.randint(-3, 4, (n,), generator=g)[f[7]].float() * TINY
        qmax = Q.QMAX[bits]                           # feature 8: scale 0.25, amax qmax / 4
        ties = (torch.randint(-qmax, qmax, (n,), generator=g).float() + 0.5) * 0.25
        x[f[8]] = ties[f[8]]
        x[f[8] & one] = qmax * 0.25
        if r is not None:
            r[f[1] | f[6] | f[7] | f[8]] = 0.0         # keep y exactly as built
    x[negzero] = -0.0
    if r is not None:
        r[negzero] = -0.0
    return x, r


def int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


QUIET_NAN = 0x7FC00000


def value_bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bits, every NaN as the one quiet NaN: a NaN's payload is not part of
    the definition (dear/fusion/quantize.py). A GPU's arithmetic writes its canonical NaN
    (0x7fffffff) where the CPU passes an operand's NaN on, and which operand's is not fixed by
    C++ either."""
    return torch.where(torch.isnan(t), torch.full_like(int_bits(t), QUIET_NAN), int_bits(t))


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype == torch.float32:
        got, want = value_bits(got), value_bits(want)
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {got.numel()} differ, first at {i}: "
                             f"native {got[i].item():#x}, reference {want[i].item():#x}")


def quantize_with(fn, x: torch.Tensor, residual: "torch.Tensor | None", block: int, bits: int,
                  device: str = "cpu"):
    """(codes, scales, new residual) of fn on copies of x and the residual on `device`."""
    n = x.numel()
    x = x.to(device)
    r = None if residual is None else residual.to(device, copy=True)
    codes, scales = code_tensor(n, bits, device), scale_tensor(n, block, device)
    fn(x, r, codes, scales, block, bits)
    return codes.cpu(), scales.cpu(), None if r is None else r.cpu()


def compare(x: torch.Tensor, residual: "torch.Tensor | None", block: int, bits: int):
    """Quantize with both; assert the native results are the reference's, bit for bit."""
    want = quantize_with(Q.quantize_reference, x, residual, block, bits)
    got = quantize_with(_ext.quantize_blocks, x, residual, block, bits)
    assert_bitwise(got[0], want[0], "codes")
    assert_bitwise(got[1], want[1], "scales")
    if residual is not None:
        assert_bitwise(got[2], want[2], "residual")
    return got


def dequantized(codes: torch.Tensor, scales: torch.Tensor, n: int, block: int,
                bits: int) -> torch.Tensor:
    """The codes decoded and dequantized by the numpy closed form."""
    q = CF.unpack(codes.numpy(), n, bits)
    return torch.from_numpy(CF.dequantize(q, scales.numpy(), block))


def assert_error_feedback(x: torch.Tensor, old: torch.Tensor, codes: torch.Tensor,
                          scales: torch.Tensor, new: torch.Tensor, block: int, bits: int) -> None:
    """The identity of the module docstring, on finite blocks; the rest sends and keeps 0."""
    n = x.numel()
    if n == 0:
        return
    finite = torch.isfinite(scales).repeat_interleave(block)[:n]
    deq = dequantized(codes, scales, n, block, bits)
    lhs = deq.double() + new.double()
    rhs = x.double() + old.double()
    larger = torch.maximum(x.abs(), old.abs())
    ulp = torch.nextafter(larger, torch.tensor(float("inf"))).double() - larger.double()
    diff = (lhs - rhs).abs()
    assert bool((diff[finite] <= ulp[finite]).all()), \
        f"error feedback lost more than one rounding: max excess {(diff - ulp)[finite].max()}"
    # Stronger, and why: the new residual is exact, so deq + new is y = fl32(x + old) itself
    # (as a value: y = -0.0 gives +0.0 + +0.0).
    y = x + old
    assert bool((lhs[finite] == y[finite].double()).all())
    q = torch.from_numpy(CF.unpack(codes.numpy(), n, bits))
    assert bool((q[~finite] == 0).all()) and bool((new[~finite] == 0).all())


# ----------------------------------------------------------------------------- closed form

IMPLS = ["reference", pytest.param("native", marks=needs_native)]


def _impl(name: str):
    return Q.quantize_reference if name == "reference" else _ext.quantize_blocks


def _dequantize_impl(name: str):
    return Q.dequantize_reference if name == "reference" else _ext.dequantize_blocks


def assert_closed_form(got, x: torch.Tensor, residual: "torch.Tensor | None", block: int,
                       bits: int, what: str) -> None:
    """(codes, scales, residual) as the numpy closed form gives them, bit for bit (a NaN scale
    as any NaN)."""
    q, scales, new = CF.quantize(x.numpy(), None if residual is None else residual.numpy(),
                                 block, bits)
    codes = torch.from_numpy(CF.pack(q, bits))
    assert_bitwise(got[0], codes, f"{what}: codes")
    assert_bitwise(got[1], torch.from_numpy(scales), f"{what}: scales")
    if residual is not None:
        assert_bitwise(got[2], torch.from_numpy(new), f"{what}: residual")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_quantize_is_the_closed_form(impl, bits, block, kind, residual) -> None:
    """Every input of test_quantize_bit_identical (special blocks, ties, subnormals, -0.0) gives
    the closed form's codes, scales and residual."""
    for n in lengths(block):
        seeds = range(FEATURES) if kind == "special" and Q.num_blocks(n, block) < 40 else [0]
        for seed in seeds:
            x, r = make_input(kind, n, block, seed, residual, bits)
            got = quantize_with(_impl(impl), x, r, block, bits)
            assert_closed_form(got, x, r, block, bits, f"{impl} n={n} seed={seed}")


@pytest.mark.parametrize("bits", BITS)
def test_closed_form_on_hand_worked_values(bits) -> None:
    """The closed form itself, on values worked out by hand. Block 0: max qmax / 16 gives scale
    1/16 (exact), and y / scale = 2.5, -2.5, 3.5, -0.5 round half to even to 2, -2, 4, -0;
    block 1 holds an inf: scale NaN, codes 0, residual 0; block 2 is zeros: scale 0, codes 0,
    y kept as the residual (its -0.0 too)."""
    qmax = CF.QMAX[bits]
    s = 1 / 16
    x = np.array([2.5 * s, -2.5 * s, 3.5 * s, -0.5 * s, qmax * s,
                  np.inf, 1.0, 2.0, -3.0, 4.0,
                  0.0, -0.0, 0.0, 0.0, 0.0], dtype=np.float32)
    r = np.zeros_like(x)
    r[11] = -0.0                                        # so y is -0.0 there
    q, scales, new = CF.quantize(x, r, 5, bits)
    assert scales[0] == s and np.isnan(scales[1]) and scales[2] == 0.0
    assert q.tolist() == [2, -2, 4, 0, qmax] + [0] * 10
    assert new.tolist() == [s / 2, -s / 2, -s / 2, -s / 2, 0] + [0] * 10
    assert np.signbit(new[11]) and not np.signbit(new[10])
    codes = CF.pack(q, bits)
    assert CF.unpack(codes, x.size, bits).tolist() == q.tolist()
    if bits == 4:                                       # 2 in the low nibble, -2 (0xE) high
        assert int(codes[0]) == 0xE2


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_dequantize_is_the_closed_form(impl, bits, block, accumulate) -> None:
    """out = q * scale (accumulate: out + q * scale, each product and sum rounded once), for
    every code (int8's -128 and int4's -8 included) and scales of every kind (0, -0.0, NaN, inf,
    subnormals)."""
    for n in lengths(block):
        codes, scales = random_codes_and_scales(n, block, bits, seed=n + block)
        g = torch.Generator().manual_seed(n)
        out = torch.randn(n, generator=g) * 100
        want = CF.dequantize(CF.unpack(codes.numpy(), n, bits), scales.numpy(), block)
        if accumulate:
            want = (out.numpy() + want).astype(np.float32)
        got = out.clone()
        _dequantize_impl(impl)(codes, scales, got, block, bits, accumulate)
        assert_bitwise(got, torch.from_numpy(want), f"{impl} n={n}: dequantized")


# ----------------------------------------------------------------------------- quantize


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_quantize_bit_identical(bits, block, kind, residual) -> None:
    for n in lengths(block):
        # Small inputs hold few blocks: cycle the special features through them.
        seeds = range(FEATURES) if kind == "special" and Q.num_blocks(n, block) < 40 else [0]
        for seed in seeds:
            x, r = make_input(kind, n, block, seed, residual, bits)
            try:
                compare(x, r, block, bits)
            except AssertionError as exc:
                raise AssertionError(f"n={n} seed={seed}: {exc}") from None


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_error_feedback_carried(bits, block) -> None:
    """Five iterations, each quantizing a new gradient plus the residual the last one left,
    native and reference side by side: equal at every step, and no value lost."""
    n = 5 * block + 3
    r_nat, r_ref = torch.zeros(n), torch.zeros(n)
    g = torch.Generator().manual_seed(block * 10 + bits)
    for step in range(5):
        x = torch.randn(n, generator=g) * 10.0 ** (step - 2)
        if step == 3:
            x[block // 2] = float("nan")               # a non-finite block resets its residual
        old = r_nat.clone()
        c_nat, s_nat = code_tensor(n, bits), scale_tensor(n, block)
        c_ref, s_ref = code_tensor(n, bits), scale_tensor(n, block)
        _ext.quantize_blocks(x, r_nat, c_nat, s_nat, block, bits)
        Q.quantize_reference(x, r_ref, c_ref, s_ref, block, bits)
        assert_bitwise(c_nat, c_ref, f"codes, step {step}")
        assert_bitwise(s_nat, s_ref, f"scales, step {step}")
        assert_bitwise(r_nat, r_ref, f"residual, step {step}")
        assert_error_feedback(x, old, c_nat, s_nat, r_nat, block, bits)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [7, 64])
def test_error_feedback_identity_reference(bits, block) -> None:
    """The identity on the reference itself, special inputs included (needs no extension)."""
    for seed in range(FEATURES):
        for n in (1, block + 1, 9 * block + 5):
            x, r = make_input("special", n, block, seed, True, bits)
            codes, scales, new = quantize_with(Q.quantize_reference, x, r, block, bits)
            assert_error_feedback(x, r, codes, scales, new, block, bits)


def test_reference_scale_underflow() -> None:
    """A finite block whose max|y| / qmax underflows to 0 (a few least subnormals): scale 0,
    codes 0, and all of y kept as the residual (not NaN)."""
    x = torch.tensor([3 * TINY, 0.0, -0.0, -2 * TINY])
    r = torch.zeros(4)
    codes, scales = code_tensor(4, 8), scale_tensor(4, 4)
    Q.quantize_reference(x, r, codes, scales, 4, 8)
    assert scales.item() == 0.0
    assert torch.equal(codes, torch.zeros(4, dtype=torch.int8))
    assert_bitwise(r, x + 0.0, "residual")


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_error_feedback_identity_native(bits, block) -> None:
    for seed in range(3):
        x, r = make_input("special", 9 * block + 5, block, seed, True, bits)
        codes, scales, new = compare(x, r, block, bits)
        assert_error_feedback(x, r, codes, scales, new, block, bits)


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [7, 64])
def test_views_at_an_offset(bits, block) -> None:
    """x and the residual as slices of larger tensors, codes and scales as typed views of one
    byte buffer (as dear/fusion/quantized.py lays out a message): the right values are read,
    and nothing around the outputs is written."""
    n = 3 * block + 1
    g = torch.Generator().manual_seed(3)
    big_x = torch.randn(n + 40, generator=g)
    big_r = torch.randn(n + 40, generator=g) * 0.01
    x, residual = big_x[13:13 + n], big_r[7:7 + n]
    nbytes = -(-Q.code_bytes(n, bits) // 4) * 4
    blocks = Q.num_blocks(n, block)
    results = []
    for fn in (_ext.quantize_blocks, Q.quantize_reference):
        raw = torch.full((8 + nbytes + 4 * blocks + 8,), 0xA5, dtype=torch.uint8)
        codes = raw[4:4 + Q.code_bytes(n, bits)]
        if bits == 8:
            codes = codes.view(torch.int8)
        scales = raw[4 + nbytes:4 + nbytes + 4 * blocks].view(torch.float32)
        big = big_r.clone()
        fn(x, big[7:7 + n], codes, scales, block, bits)
        results.append((raw, big))
    (raw_nat, big_nat), (raw_ref, big_ref) = results
    assert torch.equal(raw_nat, raw_ref)
    assert_bitwise(big_nat, big_ref, "residual and its surroundings")
    assert bool((raw_nat[:4] == 0xA5).all()) and bool((raw_nat[-8:] == 0xA5).all())
    assert torch.equal(big_nat[:7], big_r[:7]) and torch.equal(big_nat[7 + n:], big_r[7 + n:])
    assert torch.equal(residual, big_r[7:7 + n])       # the input slice itself is untouched


@needs_native
def test_module_dispatches_to_native() -> None:
    """dear.fusion.quantize.quantize/dequantize take the kernels and give the reference's
    results."""
    n, block, bits = 1000, 64, 4
    x, r = make_input("special", n, block, 1, True, bits)
    got = quantize_with(Q.quantize, x, r, block, bits)
    want = quantize_with(Q.quantize_reference, x, r, block, bits)
    for a, b, what in zip(got, want, ("codes", "scales", "residual")):
        assert_bitwise(a, b, what)
    out_nat, out_ref = torch.ones(n), torch.ones(n)
    Q.dequantize(got[0], got[1], out_nat, block, bits, accumulate=True)
    Q.dequantize_reference(want[0], want[1], out_ref, block, bits, accumulate=True)
    assert_bitwise(out_nat, out_ref, "dequantized")


# ----------------------------------------------------------------------------- dequantize


def random_codes_and_scales(n: int, block: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (Q.code_bytes(n, bits),), generator=g, dtype=torch.uint8)
    if bits == 8:
        codes = codes.view(torch.int8)                 # -128 included
    elif n % 2:
        codes[-1] &= 0xF                               # as quantize leaves an odd last byte
    nb = Q.num_blocks(n, block)
    scales = torch.randn(nb, generator=g) * 10.0 ** torch.randint(-40, 5, (nb,), generator=g)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), 5 * TINY, 1e-40])
    pick = torch.rand(nb, generator=g) < 0.3
    scales[pick] = specials[torch.randint(0, len(specials), (int(pick.sum()),), generator=g)]
    return codes, scales


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_dequantize_bit_identical(bits, block, accumulate) -> None:
    for n in lengths(block):
        codes, scales = random_codes_and_scales(n, block, bits, seed=n + block)
        g = torch.Generator().manual_seed(n)
        big = torch.randn(n + 9, generator=g) * 100
        big[::5] = -0.0
        outs = []
        for fn in (_ext.dequantize_blocks, Q.dequantize_reference):
            b = big.clone()
            fn(codes, scales, b[4:4 + n], block, bits, accumulate)   # out: a view at offset 4
            outs.append(b)
        assert_bitwise(outs[0], outs[1], f"n={n}: out and its surroundings")


@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [1, 7, 256])
def test_round_trip(bits, block) -> None:
    """Native quantize then native dequantize equals the reference's pair."""
    n = 4 * block + 3
    x, r = make_input("special", n, block, 2, True, bits)
    codes, scales, _ = compare(x, r, block, bits)
    out_nat, out_ref = torch.empty(n), torch.empty(n)
    _ext.dequantize_blocks(codes, scales, out_nat, block, bits, False)
    Q.dequantize_reference(codes, scales, out_ref, block, bits, False)
    assert_bitwise(out_nat, out_ref, "dequantized")


# ----------------------------------------------------------------------------- bad arguments


def _q(x=None, residual=None, codes=None, scales=None, block=4, bits=8, n=10):
    x = torch.randn(n) if x is None else x
    m = x.numel()
    codes = code_tensor(m, bits) if codes is None else codes
    scales = scale_tensor(m, max(block, 1)) if scales is None else scales
    return lambda: _ext.quantize_blocks(x, residual, codes, scales, block, bits)


def _dq(codes=None, scales=None, out=None, block=4, bits=8, n=10):
    out = torch.zeros(n) if out is None else out
    m = out.numel()
    codes = code_tensor(m, bits) if codes is None else codes
    scales = scale_tensor(m, max(block, 1)) if scales is None else scales
    return lambda: _ext.dequantize_blocks(codes, scales, out, block, bits, True)


def _shared_x():
    x = torch.randn(20)
    return _q(x=x[:10], residual=x[5:15])


BAD = {
    "bits": (lambda: _q(bits=5), r"bits must be 8 or 4, got 5"),
    "block": (lambda: _q(block=0), r"block must be positive, got 0"),
    "x dtype": (lambda: _q(x=torch.randn(10, dtype=torch.float64)),
                r"x must be torch.float32, got Double"),
    "x 2-D": (lambda: _q(x=torch.randn(2, 5)), r"x must be 1-D"),
    "x strided": (lambda: _q(x=torch.randn(20)[::2]), r"x must be contiguous"),
    "x device": (lambda: _q(x=torch.empty(10, device="meta")), r"x is on meta"),
    "codes dtype": (lambda: _q(codes=torch.zeros(10, dtype=torch.uint8)),
                    r"codes must be torch.int8, got torch.uint8"),
    "codes int4 dtype": (lambda: _q(bits=4, codes=torch.zeros(5, dtype=torch.int8)),
                         r"codes must be torch.uint8, got torch.int8"),
    "codes size": (lambda: _q(codes=torch.zeros(9, dtype=torch.int8)),
                   r"codes must have 10 elements"),
    "codes int4 size": (lambda: _q(bits=4, codes=torch.zeros(10, dtype=torch.uint8)),
                        r"codes must have 5 elements"),
    "codes device": (lambda: _q(codes=torch.empty(10, dtype=torch.int8, device="meta")),
                     r"codes is on meta but the other tensors are on cpu"),
    "scales size": (lambda: _q(scales=torch.zeros(2)), r"scales must have 3 elements"),
    "scales dtype": (lambda: _q(scales=torch.zeros(3, dtype=torch.float16)),
                     r"scales must be torch.float32"),
    "residual size": (lambda: _q(residual=torch.zeros(11)), r"residual must have 10 elements"),
    "residual dtype": (lambda: _q(residual=torch.zeros(10, dtype=torch.float64)),
                       r"residual must be torch.float32"),
    "residual is x": (lambda: (lambda x: _q(x=x, residual=x))(torch.randn(10)),
                      r"x and residual share memory"),
    "residual overlaps x": (_shared_x, r"x and residual share memory"),
    "out dtype": (lambda: _dq(out=torch.zeros(10, dtype=torch.float64)),
                  r"out must be torch.float32"),
    "out strided": (lambda: _dq(out=torch.zeros(20)[::2]), r"out must be contiguous"),
    "dq bits": (lambda: _dq(bits=3), r"bits must be 8 or 4, got 3"),
    "dq block": (lambda: _dq(block=-1), r"block must be positive"),
    "dq codes size": (lambda: _dq(bits=4, codes=torch.zeros(6, dtype=torch.uint8)),
                      r"codes must have 5 elements"),
    "dq scales size": (lambda: _dq(scales=torch.zeros(4)), r"scales must have 3 elements"),
}


@needs_native
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_arguments(case) -> None:
    make, message = BAD[case]
    with pytest.raises(RuntimeError, match=message):
        make()()


@needs_native
def test_empty_and_none() -> None:
    """n = 0 writes nothing and needs no blocks; residual may be None (keyword too)."""
    _ext.quantize_blocks(torch.empty(0), None, code_tensor(0, 4), scale_tensor(0, 8), 8, 4)
    _ext.dequantize_blocks(code_tensor(0, 8), scale_tensor(0, 8), torch.empty(0), 8, 8, True)
    x = torch.randn(9)
    codes, scales = code_tensor(9, 4), scale_tensor(9, 8)
    _ext.quantize_blocks(x=x, residual=None, codes=codes, scales=scales, block=8, bits=4)
    want = quantize_with(Q.quantize_reference, x, None, 8, 4)
    assert torch.equal(codes, want[0]) and torch.equal(int_bits(scales), int_bits(want[1]))


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not native.build_info().get("cuda"),
                    reason="the extension was built without CUDA")
@needs_native
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_bit_identical(bits, block) -> None:
    """csrc/cuda/quantize_kernels.cu against the reference on the CPU and on the GPU, and
    against the numpy closed form."""
    for n in lengths(block):
        seeds = range(FEATURES) if Q.num_blocks(n, block) < 40 else [0]
        for seed in seeds:
            for residual in (False, True):
                x, r = make_input("special", n, block, seed, residual, bits)
                want = quantize_with(Q.quantize_reference, x, r, block, bits)
                for fn in (Q.quantize_reference, _ext.quantize_blocks):
                    got = quantize_with(fn, x, r, block, bits, device="cuda")
                    for a, b, what in zip(got, want, ("codes", "scales", "residual")):
                        if b is not None:
                            assert_bitwise(a, b, f"{fn.__name__} n={n} seed={seed}: {what}")
                    assert_closed_form(got, x, r, block, bits,
                                       f"{fn.__name__} on cuda n={n} seed={seed}")
                out = torch.randn(n)
                want_out = out.clone()
                Q.dequantize_reference(want[0], want[1], want_out, block, bits, True)
                got_out = out.cuda()
                _ext.dequantize_blocks(want[0].cuda(), want[1].cuda(), got_out, block, bits, True)
                assert_bitwise(got_out.cpu(), want_out, f"n={n} seed={seed}: dequantized")
