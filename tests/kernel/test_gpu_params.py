"""The kernels' parameter structs (apa_gpu/params.py, cuda/params.cuh): packing refuses what could
bind a value to the wrong field, and the device refuses a struct whose layout differs from the one the
module exports. The packing tests need no device; the layout tests are marked ``gpu``."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import apa_gpu
from apa_emu.config import Config
from apa_emu.geometry import Shape
from apa_gpu import device, probes
from apa_gpu.build import PROBE, Variant
from apa_gpu.params import (CUDA_DIR, F32, FUSED, GEOM_SIZES, I32, I64, PASS1, PASS2, PASS2_ARGS, PREP, PTR, Struct,
                            declared, name_hash)
from apa_gpu.plan import Plan


class _Buf:
    """A stand-in device array whose address is known."""

    def __init__(self, addr):
        self.addr = addr


INTS = dict(n=5, H=6, Hkv=2, S=300, q_offset=295, window=0, S_buf=640)
_SHAPE = Shape(B=1, n=5, H=6, Hkv=2, S=300, d=64, q_offset=295)
_QKV = (np.zeros((5, 6, 64), np.float16), np.zeros((300, 2, 64), np.float16), np.zeros((300, 2, 64), np.float16), 295)
SIZES = INTS | dict(cu_q=None, cu_k=_Buf(0x9000))  # a null and a set pointer, each in its own field


def _pass2_values(**over):
    ptrs = {f: _Buf(0x1000 * (i + 1)) for i, (f, t) in enumerate(PASS2_ARGS.fields) if t is PTR}
    cert = dict(sd=8.0, cs=2.0**-9, c2=2.0**-7, fast=0.0, delta=32.0)
    est_k = dict(rho=2.0**-7, cs=2.0**-24, cp=2.0**-25, ca=2.0**-23, z=2.0)
    pages = dict(table=None, page_size=0, max_pages=0)
    return dict(ptrs, pages=pages, qmul=np.float32(0.125), all_hot=True, fma=False, direct=False, cert=cert,
                est_k=est_k) | over


def test_pack_places_every_field_at_its_offset():
    rec = PASS2.pack(dict(sz=SIZES, pass2=_pass2_values(trace_rows=None)), lambda b: b.addr)
    assert rec.shape == (1,) and rec.dtype.itemsize == PASS2.dtype.itemsize
    assert {f: int(rec["sz"][f][0]) for f in INTS} == INTS
    assert (int(rec["sz"]["cu_q"][0]), int(rec["sz"]["cu_k"][0])) == (0, 0x9000)
    p2 = rec["pass2"]
    assert int(p2["q"][0]) == 0x1000 and int(p2["trace_rows"][0]) == 0
    assert p2["qmul"][0] == np.float32(0.125) and int(p2["all_hot"][0]) == 1
    assert p2["cert"]["cs"][0] == np.float32(2.0**-9) and p2["cert"]["delta"][0] == np.float32(32)


def _random_values(struct, rng):
    out = {}
    for f, t in struct.fields:
        if isinstance(t, Struct):
            out[f] = _random_values(t, rng)
        elif t is PTR:
            out[f] = None if rng.random() < 0.2 else _Buf(int(rng.integers(1, 2**63)))
        elif t is F32:
            out[f] = [float(rng.standard_normal()), np.float32(rng.standard_normal() * 1e30), True][rng.integers(3)]
        else:
            info = np.iinfo(t)
            out[f] = [int(rng.integers(info.min, info.max, endpoint=True)), np.int32(-7), False][rng.integers(3)]
    return out


def _read_back(rec, struct):
    return {f: _read_back(rec[f], t) if isinstance(t, Struct) else rec[f][0] for f, t in struct.fields}


def _expected(values, struct):
    """Each value as NumPy's assignment to the field's dtype converts it; pointers as addresses."""
    return {f: _expected(v, t) if isinstance(t, Struct) else (0 if v is None else v.addr) if t is PTR
            else np.asarray(v).astype(t)[()] for (f, t), v in zip(struct.fields, values.values())}


@pytest.mark.parametrize("struct", [PREP, PASS1, PASS2, FUSED, *probes.KERNELS.values()], ids=lambda s: s.name)
def test_pack_round_trips_through_the_dtype(struct):
    """Every field, nested ones too, reads back through the NumPy dtype (C's alignment: the layout the
    module's export is checked against) as NumPy would have stored it, and padding bytes are zero."""
    rng = np.random.default_rng(7)
    for _ in range(20):
        values = _random_values(struct, rng)
        rec = struct.pack(values, lambda b: b.addr)
        assert rec.shape == (1,) and rec.dtype == struct.dtype
        got, want = _read_back(rec, struct), _expected(values, struct)
        assert got == want
        # the bytes that belong to no field are zero
        mask = np.zeros(struct.dtype.itemsize, bool)

        def cover(dt, base):
            for f in dt.names:
                sub, off = dt.fields[f][:2]
                if sub.names:
                    cover(sub, base + off)
                else:
                    mask[base + off: base + off + sub.itemsize] = True
        cover(struct.dtype, 0)
        assert not rec.view(np.uint8)[~mask].any()


@pytest.mark.parametrize("values, what", [
    (dict(sz=SIZES), "missing"),
    (dict(sz=SIZES, pass2=_pass2_values(), extra=1), "unknown"),
    (dict(sz=SIZES, pass2=_pass2_values(q=0)), "pointer"),
    (dict(sz=SIZES, pass2=_pass2_values(qmul=_Buf(8))), "number"),
    (dict(sz=SIZES | dict(S=2**31), pass2=_pass2_values()), r"^Pass2Params.sz.S: 2147483648 is out of range"),
])
def test_pack_refuses(values, what):
    with pytest.raises((TypeError, ValueError), match=what):
        PASS2.pack(values, lambda b: b.addr)


def test_layout_has_c_alignment_and_names():
    # a pointer after an odd number of ints is padded to 8 bytes, as in C; FNV-1a as cuda/params.cuh
    s = Struct("T", [("a", I32), ("p", PTR), ("f", F32)])
    assert s.layout() == [24, 0, 4, name_hash("a"), 8, 8, name_hash("p"), 16, 4, name_hash("f")]
    assert name_hash("") == 2166136261 - (1 << 32) and name_hash("a") == 0xE40C292C - (1 << 32)


APA_KERNELS = {"apa_prep_stats": PREP, "apa_prep_finalize": PREP, "apa_prep_q": PREP, "apa_prep_k": PREP,
               "apa_prep_v": PREP, "apa_prep_means": PREP, "apa_pass1": PASS1, "apa_pass1_segment": PASS1,
               "apa_pass1_budget": PASS1, "apa_pass1_segment_budget": PASS1, "apa_pass2": PASS2, "apa_fused": FUSED,
               "apa_fused_budget": FUSED}
PROBE_KERNELS = {"apa_probe_mma_f32": probes.MMA_F32, "apa_probe_mma_f16": probes.MMA_F16,
                 "apa_probe_exp2": probes.EXP2, "apa_probe_codes": probes.CODES, "apa_probe_quant16": probes.QUANT16,
                 "apa_probe_tables": probes.TABLES, "apa_probe_pscale": probes.PSCALE, "apa_probe_merge": probes.MERGE}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [Variant(d=64), PROBE], ids=["apa", "probe"])
def test_every_kernel_struct_matches_its_module(variant):
    for name, struct in (PROBE_KERNELS if variant == PROBE else APA_KERNELS).items():
        assert device.kernel(variant, name, struct).struct is struct


@pytest.mark.gpu
def test_reordered_struct_is_refused():
    fields = list(PASS2_ARGS.fields)
    fields[-2], fields[-1] = fields[-1], fields[-2]  # qmul and all_hot: the same size, swapped
    bad = Struct("Pass2Params", [("sz", GEOM_SIZES), ("pass2", Struct("Pass2Args", fields))])
    with pytest.raises(RuntimeError, match="Pass2Args"):
        device.kernel(Variant(d=64), "apa_pass2", bad)


def _sources(tmp_path, file: str, *edits: tuple[str, str]):
    """A copy of cuda/ with ``edits`` (old, new) made in turn in ``file`` (each old occurring once)."""
    cuda = tmp_path / "cuda"
    shutil.copytree(CUDA_DIR, cuda, ignore=shutil.ignore_patterns("sim"))
    text = (cuda / file).read_text()
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (cuda / file).write_text(text)
    return cuda


def test_structs_are_read_from_their_field_lists(tmp_path):
    """A field added to an X-macro line list reaches the host's struct and every struct nesting it, in
    place and with C's alignment, with no other edit (cuda/params.cuh APA_FIELDS_S)."""
    structs = declared(_sources(tmp_path, "pass1.cuh", ("X(int, direct) ", "X(long long, extra) X(int, direct) ")))
    args = structs["Pass1Args"]
    assert [f for f, _ in args.fields][-3:] == ["pad_vote", "extra", "direct"] and dict(args.fields)["extra"] is I64
    assert args.dtype.fields["extra"][1] % 8 == 0 and args.dtype.itemsize == PASS1.dtype["pass1"].itemsize + 16
    assert structs["FusedParams"].dtype["pass1"] == args.dtype and dict(structs["Pass1Params"].fields)["pass1"] is args
    assert declared().keys() == structs.keys() and declared()["Pass2Args"].layout() == PASS2_ARGS.layout()


def test_a_field_type_the_host_cannot_hold_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"pass2\.cuh Pass2Args\.fma: type 'bool' is not a pointer"):
        declared(_sources(tmp_path, "pass2.cuh", ("X(int, fma)", "X(bool, fma)")))


@pytest.mark.gpu
def test_module_built_from_other_field_lists_is_refused(tmp_path):
    """The exported layout checks the host's reading of the field lists: a host that read lists with
    two fields of one size swapped (the kernel keeps its own order) does not launch."""
    swap = (("X(int, fma)", "X(int, tmp)"), ("X(int, direct)", "X(int, fma)"), ("X(int, tmp)", "X(int, direct)"))
    bad = declared(_sources(tmp_path, "pass2.cuh", *swap))
    names = [f for f, _ in bad["Pass2Args"].fields]
    assert names.index("direct") + 1 == names.index("fma")
    with pytest.raises(RuntimeError, match="Pass2Args"):
        device.kernel(Variant(d=64), "apa_pass2", bad["Pass2Params"])


@pytest.mark.parametrize("call, message", [
    (lambda: apa_gpu.attention(*_QKV, schedule="separate", segment_tiles=4),
     r"^segment_tiles=4: only the bounded schedule has segments, not schedule='separate'$"),
    (lambda: Plan(_SHAPE, Config(), schedule="bounded", segment=0), r"^segment=0: expected a positive number of tiles$"),
    (lambda: Plan(_SHAPE, Config(), schedule="bounded", segment=True), r"^segment=True: expected a positive"),
    (lambda: Plan(_SHAPE, Config(), schedule="ring"), r"^schedule='ring': expected one of separate, fused, bounded$"),
])
def test_bounded_schedule_refuses_bad_arguments(call, message):
    """One-line errors before anything is built or launched (no GPU needed)."""
    with pytest.raises(ValueError, match=message):
        call()


def test_bounded_segments_follow_the_visiting_order():
    """§6.7: tiles after the sink in segments of T, highest first for the diagonal order."""
    plan = object.__new__(Plan)
    plan.shape, plan.segment = _SHAPE, 2  # 300 keys: 5 tiles, the sink and 4 after it
    plan.cfg = Config()
    assert plan.segments() == [(3, 5), (1, 3)]
    plan.cfg = Config(tile_order="ascending")
    assert plan.segments() == [(1, 3), (3, 5)]
    plan.shape = Shape(B=1, n=1, H=1, Hkv=1, S=10, d=64, q_offset=9)  # one tile: an empty segment, the sink
    assert plan.segments() == [(1, 1)]
