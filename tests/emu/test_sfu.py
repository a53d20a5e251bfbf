"""The special-function models (numerics.md §13, apa_emu/sfu.py) against the hardware's recorded outputs:
`tests/emu/data/sfu_samples_h100.npz` holds an H100's results on each instruction's hard cases
(special classes, the thresholds of §13.1, binade edges, integers) and on random inputs, written by
``tools/sfu_check.py --samples`` (apa_gpu/sfu.py ``sample_inputs``). The exhaustive check is that
tool's, on the GPU (docs/results/gpu-log.md); here CI checks the models on the stored samples."""

from pathlib import Path

import numpy as np
import pytest

from apa_emu import sfu

SAMPLES = Path(__file__).with_name("data") / "sfu_samples_h100.npz"
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
