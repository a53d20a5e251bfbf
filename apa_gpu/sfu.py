"""The special-function models of apa_emu/sfu.py against this GPU (numerics.md §13): measure their
tables here, and check every model on every input it has (division on random pairs and its special
classes). ``tools/sfu_check.py`` is the command.

The hardware evaluates chunks of inputs (cuda/sfu.cu); the models run on the host, in parallel over
elements, and the two are compared bit for bit, NaN bits included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from apa_emu import sfu

from . import device
from .build import SFU
from .params import DECLARED

OPS = {"ex2.approx.ftz.f32": 0, "ex2.approx.f32": 1, "ex2.approx.f16": 2, "ex2.approx.f16x2": 3,
       "rcp.approx.ftz.f32": 4, "rcp.approx.f32": 5, "div.full.f32": 6, "lg2.approx.ftz.f32": 7}
CHUNK = 1 << 26  # inputs per launch and comparison: 256 MB of results


def evaluate(name: str, a=None, b=None, start: int = 0, count: int | None = None):
    """The bits of instruction ``name`` on the GPU: of the bit patterns ``a`` (and divisors ``b``),
    or of ``count`` consecutive patterns from ``start``. A CuPy uint32 array."""
    xp = device.backend().xp
    a = None if a is None else xp.asarray(np.asarray(a).view(np.uint32) if isinstance(a, np.ndarray) else a)
    b = None if b is None else xp.asarray(np.asarray(b).view(np.uint32) if isinstance(b, np.ndarray) else b)
    n = int(a.size if a is not None else count)
    out = xp.empty(n, np.uint32)
    k = device.kernel(SFU, "apa_sfu", DECLARED["SfuParams"])
    blocks = min(-(-n // 256), 65536)
    device.launch(k, (blocks,), 256, dict(a=a, b=b, out=out, start=start, count=n, op=OPS[name]))
    return out


def measure() -> sfu.Tables:
    """The three tables of §13, read from this GPU."""
    f = np.arange(1 << sfu.FRACTION_BITS, dtype=np.float64) * 2.0**-sfu.FRACTION_BITS
    ex2 = evaluate("ex2.approx.ftz.f32", np.concatenate([f, -f]).astype(np.float32))
    rcp = evaluate("rcp.approx.ftz.f32", start=0x3F800000, count=1 << 23)
    h = evaluate("ex2.approx.f16", start=0, count=1 << 16)
    return sfu.Tables(ex2.get().view(np.float32), rcp.get().view(np.float32), h.get().astype(np.uint16))


@dataclass
class Report:
    """One instruction's comparison: inputs checked, how many differ, the first few differences as
    (input bits..., hardware bits, model bits)."""

    name: str
    inputs: int = 0
    differing: int = 0
    first: list = field(default_factory=list)
    by_binade: np.ndarray = field(default_factory=lambda: np.zeros(512, np.int64))  # sign and exponent of input 1

    def add(self, inputs: tuple, hw: np.ndarray, model: np.ndarray, keep: int = 5) -> None:
        bad = np.flatnonzero(hw != model)
        self.inputs += hw.size
        self.differing += bad.size
        np.add.at(self.by_binade, inputs[0][bad] >> 23, 1)
        for i in bad[:max(0, keep - len(self.first))]:
            self.first.append((*(int(x[i]) for x in inputs), int(hw[i]), int(model[i])))

    def lines(self) -> list[str]:
        """The verdict line, then where the differences are: the first few as input bits..., hardware
        bits, model bits, and the count per binade of the (first) input."""
        out = [f"{self.name}: {self.inputs:,} inputs, {self.differing:,} differ"]
        if self.first:
            out[0] += "; first: " + ", ".join(" ".join(f"{v:#010x}" for v in d) for d in self.first[:3])
            worst = np.argsort(self.by_binade)[::-1][:8]
            out.append("  by binade of the input: " + ", ".join(
                f"{'-' if b >> 8 else '+'}2^{(b & 255) - 127}: {self.by_binade[b]:,}" for b in worst if self.by_binade[b]))
        return out


def check_unary(name: str, t: sfu.Tables, progress: Callable[[int], None] = lambda n: None) -> Report:
    """Every one of the 2³² binary32 inputs of a unary binary32 instruction."""
    rep = Report(name)
    for start in range(0, 1 << 32, CHUNK):
        hw = evaluate(name, start=start, count=CHUNK).get()
        x = np.arange(CHUNK, dtype=np.uint32) + np.uint32(start)
        rep.add((x,), hw, sfu.unary_array(name, x.view(np.float32), t).view(np.uint32))
        progress(CHUNK)
    return rep


def check_f16(t: sfu.Tables) -> list[Report]:
    """ex2.approx.f16 on every binary16 input, and ex2.approx.f16x2 on every input in each half."""
    h = np.arange(1 << 16, dtype=np.uint32)
    one, two = Report("ex2.approx.f16"), Report("ex2.approx.f16x2")
    one.add((h,), evaluate("ex2.approx.f16", start=0, count=h.size).get() & 0xFFFF,
            sfu.ex2_f16_array(h.astype(np.uint16), t).view(np.uint16).astype(np.uint32))
    pair = h | (np.random.default_rng(0).permutation(h) << 16)
    model = sfu.ex2_f16_array((pair & 0xFFFF).astype(np.uint16), t).view(np.uint16).astype(np.uint32)
    model |= sfu.ex2_f16_array((pair >> 16).astype(np.uint16), t).view(np.uint16).astype(np.uint32) << 16
    two.add((pair,), evaluate("ex2.approx.f16x2", pair).get(), model)
    return [one, two]


def special_operands() -> np.ndarray:
    """Binary32 bit patterns of division's special classes: signed zeros, subnormals, the normal
    range's ends and the scaling thresholds 2^±126 with their neighbours, powers of two, infinities, NaN."""
    mags = [0, 1, 2, 3, 0x7FFFF, 0x400000, 0x7FFFFE, 0x7FFFFF, 0x800000, 0x800001, 0xFFFFFF, 0x3F800000,
            0x3F800001, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F7FFFFE, 0x7F800000, 0x7FC00000, 0x7F800001]
    for e in (1, 2, 3, 24, 25, 26, 101, 102, 127, 152, 153, 229, 252, 253, 254):
        mags += [e << 23, (e << 23) - 1, (e << 23) + 1, (e << 23) | 0x555555, (e << 23) | 0x7FFFFF]
    rng = np.random.default_rng(1)
    mags += list(rng.integers(0, 0x7F800000, 200))
    m = np.unique(np.asarray(mags, np.uint32))
    return np.concatenate([m, m | np.uint32(0x80000000)])


def _pairs(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """n random operand pairs: half uniform over all bit patterns, half with a's exponent within 40
    of b's, so that most quotients are finite and normal."""
    a = rng.integers(0, 1 << 32, n, dtype=np.uint32)
    b = rng.integers(0, 1 << 32, n, dtype=np.uint32)
    near = n // 2
    e = ((b[:near] >> 23) & 0xFF).astype(np.int64) + rng.integers(-40, 41, near)
    a[:near] = (a[:near] & np.uint32(0x807FFFFF)) | (np.clip(e, 0, 254).astype(np.uint32) << 23)
    return a, b


def check_div(t: sfu.Tables, pairs: int, seed: int = 0, progress: Callable[[int], None] = lambda n: None) -> Report:
    """div.full.f32 on every pair of special_operands() and on ``pairs`` random pairs."""
    rep = Report("div.full.f32")
    s = special_operands()
    a, b = np.repeat(s, s.size), np.tile(s, s.size)
    rng = np.random.default_rng(seed)
    done = 0
    while True:
        hw = evaluate("div.full.f32", a, b).get()
        rep.add((a, b), hw, sfu.div_array(a.view(np.float32), b.view(np.float32), t).view(np.uint32))
        progress(a.size)
        n = min(CHUNK, pairs - done)
        if n <= 0:
            return rep
        a, b = _pairs(rng, n)
        done += n


def sample_inputs(seed: int = 0, random: int = 2000) -> dict[str, tuple[np.ndarray, ...]]:
    """Inputs for the stored hardware samples (tests/emu/test_sfu.py): per instruction its hard cases
    (special classes, the thresholds of §13, binade edges, integers) and ``random`` random ones."""
    rng = np.random.default_rng(seed)
    s = special_operands()
    edges = np.float32([-127, -126.5, -126, -125, -1, -0.5, 0.5, 1, 127, 127.5, 127.99998, 128, 2.0**-24, -2.0**-24,
                        2.0**-23, -2.0**-23, 2.0**-30, -2.0**-30])
    near = np.concatenate([np.nextafter(edges, np.float32(np.inf)), np.nextafter(edges, np.float32(-np.inf)), edges])
    ex2 = np.concatenate([s, near.view(np.uint32), np.arange(-130, 131, dtype=np.float32).view(np.uint32),
                          rng.uniform(-130, 130, random).astype(np.float32).view(np.uint32),
                          rng.integers(0, 1 << 32, random, dtype=np.uint32)])
    rcp = np.concatenate([s, rng.integers(0, 1 << 32, random, dtype=np.uint32)])
    pick = rng.choice(s.size * s.size, random, replace=False)
    a, b = _pairs(rng, random)
    return {"ex2.approx.ftz.f32": (ex2,), "ex2.approx.f32": (ex2,), "rcp.approx.ftz.f32": (rcp,),
            "rcp.approx.f32": (rcp,), "ex2.approx.f16": (np.arange(1 << 16, dtype=np.uint32),),
            "div.full.f32": (np.concatenate([s[pick // s.size], a]), np.concatenate([s[pick % s.size], b]))}


def samples(seed: int = 0) -> dict[str, np.ndarray]:
    """The hardware's results on sample_inputs(seed), for storing beside the tests: per instruction
    NAME, arrays NAME/in0 (and NAME/in1) and NAME/out of bits."""
    out = {}
    for name, inputs in sample_inputs(seed).items():
        for i, x in enumerate(inputs):
            out[f"{name}/in{i}"] = x
        hw = evaluate(name, *inputs) if name == "div.full.f32" else evaluate(name, inputs[0])
        out[f"{name}/out"] = hw.get()
    return out
