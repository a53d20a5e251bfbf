"""The special-function models (numerics.md §13, apa_emu/sfu.py) against the hardware's recorded outputs:
`tests/emu/data/sfu_samples_h200.npz` holds an H200's results on each instruction's hard cases
(special classes, the thresholds of §13.1, binade edges, integers) and on random inputs, written by
``tools/sfu_check.py --samples`` (apa_gpu/sfu.py ``sample_inputs``). The exhaustive check is that
tool's, on the GPU (docs/results/gpu-log.md); here CI checks the models on the stored samples."""

from pathlib import Path

import numpy as np
import pytest

from apa_emu import sfu

SAMPLES = Path(__file__).with_name("data") / "sfu_samples_h200.npz"
UNARY = tuple(sfu.UNARY)


@pytest.fixture(scope="module")
def hw():
    if not SAMPLES.is_file():
        pytest.skip(f"no hardware samples recorded yet: {SAMPLES.name} is written on a GPU by "
                    "tools/sfu_check.py --samples")
    with np.load(SAMPLES) as z:
        return {k: z[k] for k in z.files}


def _model(name, inputs):
    if name == "div.full.f32":
        return sfu.div_array(inputs[0].view(np.float32), inputs[1].view(np.float32)).view(np.uint32)
    if name == "ex2.approx.f16":
        return sfu.ex2_f16_array(inputs[0].astype(np.uint16)).view(np.uint16).astype(np.uint32)
    return sfu.unary_array(name, inputs[0].view(np.float32)).view(np.uint32)


@pytest.mark.parametrize("name", [*UNARY, "ex2.approx.f16", "div.full.f32"])
def test_model_equals_the_recorded_hardware(hw, name):
    inputs = [hw[f"{name}/in{i}"] for i in range(2) if f"{name}/in{i}" in hw]
    want = hw[f"{name}/out"]
    got = _model(name, inputs)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{name}: {bad.size} of {want.size} differ; first input(s) "
                           f"{[hex(int(x[bad[0]])) for x in inputs]}: hardware {int(want[bad[0]]):#x}, model {int(got[bad[0]]):#x}")


def test_the_samples_hold_the_hard_cases(hw):
    """The recorded results meet what the models must get right: flushes, subnormal results of the
    non-ftz expansions, NaN bits, the scaling branches of rcp and div, and results off the table grid."""
    x = hw["ex2.approx.f32/in0"].view(np.float32)
    ftz, full = hw["ex2.approx.ftz.f32/out"].view(np.float32), hw["ex2.approx.f32/out"].view(np.float32)
    assert ((ftz == 0) & (full > 0)).any()  # below 2⁻¹²⁶: MUFU flushes, the expansion keeps subnormals
    assert (np.isnan(ftz) & (hw["ex2.approx.ftz.f32/out"] == sfu.NAN_BITS)).any()
    off_grid = np.isfinite(x) & (np.abs(x) < 1) & (x * 2.0**23 != np.floor(x * np.float64(2.0**23)))
    assert off_grid.sum() > 100
    r = hw["rcp.approx.f32/in0"].view(np.float32)
    assert (np.abs(r) > 2.0**126).any() and ((np.abs(r) < 2.0**-126) & (r != 0)).any()
    b = hw["div.full.f32/in1"].view(np.float32)
    assert (np.abs(b) > 2.0**126).sum() > 50 and ((np.abs(b) < 2.0**-126) & (b != 0)).sum() > 50


def test_tables_round_trip_through_their_packed_form():
    t = sfu.tables()
    again = sfu.unpack(sfu.pack(t))
    for a, b in zip(t, again):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert t.ex2[0] == 1 and t.rcp[0] == 1  # exp2(0) and 1/1 are exact on the unit


def test_missing_tables_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("APA_SFU_TABLES", str(tmp_path / "none.npz"))
    with pytest.raises(FileNotFoundError, match="no special-function tables at .*none.npz"):
        sfu.tables()


def _ref_ex2(x: np.ndarray) -> np.ndarray:
    """§13.2 on the stand-in tables, computed independently in binary64: |x| truncated to a multiple
    of 2⁻²³, n + f, and 2ⁿ·RN(2^f) for x ≥ 0, 2⁻ⁿ·RN(2^−f) for x < 0 (the stand-in's entries are
    exp2 rounded once), flushed below 2⁻¹²⁶."""
    xd = x.astype(np.float64)
    sign = np.where(xd < 0, -1.0, 1.0)
    with np.errstate(over="ignore", invalid="ignore"):
        fx = np.floor(np.abs(xd) * 2.0**23)
        n = np.floor(fx / 2.0**23)
        frac = np.exp2(sign * (fx - n * 2.0**23) / 2.0**23).astype(np.float32).astype(np.float64)
        r = (frac * np.exp2(sign * n)).astype(np.float32)
    r = np.where(r < np.float32(2.0**-126), np.float32(0), r)
    r = np.where(np.abs(xd) < 2.0**-126, np.float32(1), r)
    return np.where(xd >= 128, np.float32(np.inf), np.where(xd < -127, np.float32(0), r)).astype(np.float32)


def test_ex2_models_read_their_table_as_section_13_2_says():
    """On the stand-in tables (hardware-free), MUFU.EX2 and ex2.approx.f32's expansion against a
    binary64 derivation of §13.1–13.2: off-grid inputs (truncated, negatives included), the flush below
    2⁻¹²⁶ and the expansion's subnormal results, subnormal inputs, the range ends."""
    t = sfu.standin()
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-130, 130, 20000), rng.uniform(-1, 1, 5000) * 2.0**-20,
                        [-127.5, -126.5, -126, 127.99, 128, 1e-40, -1e-40, 0.0, -0.0]]).astype(np.float32)
    got = sfu.unary_array("ex2.approx.ftz.f32", x, t)
    assert np.array_equal(got.view(np.uint32), _ref_ex2(x).view(np.uint32))
    full = sfu.unary_array("ex2.approx.f32", x, t)
    low = x < -126
    want = np.where(low, _ref_ex2(x * np.float32(0.5)) ** 2, _ref_ex2(x)).astype(np.float32)
    assert np.array_equal(full.view(np.uint32), want.view(np.uint32))
    assert ((full > 0) & (got == 0)).any() and (np.floor(x * 2.0**23) != x * 2.0**23).sum() > 4000


def test_rcp_and_division_models_follow_section_13_3():
    """On the stand-in tables, MUFU.RCP is the table at the 23 fraction bits times 2⁻ᵉ with the flushes
    of §13.3, and rcp.approx and div.full scale as §13.1 says: checked against binary64."""
    t = sfu.standin()
    rng = np.random.default_rng(4)
    x = (rng.integers(0, 1 << 32, 20000, dtype=np.uint64).astype(np.uint32)).view(np.float32)
    x = x[np.isfinite(x)]
    ax = np.abs(x.astype(np.float64))
    with np.errstate(divide="ignore", over="ignore"):
        ref = np.where(ax < 2.0**-126, np.inf, (1.0 / ax).astype(np.float32).astype(np.float64))
    ref = np.where(ref < 2.0**-126, 0.0, ref) * np.where(np.signbit(x), -1.0, 1.0)
    got = sfu.unary_array("rcp.approx.ftz.f32", x, t)
    assert np.array_equal(got, ref.astype(np.float32)) and (got == 0).any() and np.isinf(got).any()
    b = x[(np.abs(x) > 2.0**126) | ((np.abs(x) < 2.0**-126) & (x != 0))]
    a = np.full_like(b, np.float32(3.0))
    s = np.where(np.abs(b) > 2.0**126, np.float32(0.25), np.float32(2.0**24))
    want = sfu.unary_array("rcp.approx.ftz.f32", b * s, t) * (a * s)
    assert b.size > 100 and np.array_equal(sfu.div_array(a, b, t), want)
