"""The trace comparison used by the kernel cross-check (numerics.md §1.7, §10)."""

import numpy as np

from apa_emu import Config, attention
from apa_emu import trace as tr
from apa_emu.study.synth import synthetic


def traced():
    d = synthetic(40, 300, 6, 2, 64, seed=3)
    return attention(d.q, d.k, d.v, d.q_offset, Config(), trace="all")


def test_first_difference_names_record_field_and_element():
    a, b = traced(), traced()
    assert tr.first_difference(a.visits, b.visits, tr.VISIT_FIELDS) is None
    b.visits["la"][5, 3] = np.float32(1.0)
    b.visits["tl"][9, 0] = np.float32(2.0)
    d = tr.first_difference(a.visits, b.visits, tr.VISIT_FIELDS)
    assert (d["record"], d["field"], d["element"], d["right"]) == (5, "la", 3, np.float32(1.0))
    assert (d["b"], d["hk"], d["warp"], d["visit"]) == tuple(int(a.visits[k][5]) for k in ("b", "hk", "warp", "visit"))


def test_scalar_fields_signed_zero_and_nan_payloads():
    a, b = traced(), traced()
    keys = ("b", "hk", "row")
    b.rows["l2"][4] = -b.rows["l2"][4] if b.rows["l2"][4] == 0 else np.nextafter(b.rows["l2"][4], np.float32(0))
    d = tr.first_difference(a.rows, b.rows, tr.ROW_FIELDS, keys)
    assert (d["record"], d["field"], d["element"]) == (4, "l2", None)
    c = traced()
    a.rows["part"][2, 1] = np.uint32(0x7FC00001).view(np.float32)
    c.rows["part"][2, 1] = np.uint32(0xFFC00000).view(np.float32)
    assert tr.first_difference(a.rows, c.rows, tr.ROW_FIELDS, keys) is None


def test_empty_traces_are_equal():
    empty = np.zeros(0, tr.VISIT_DTYPE)
    assert tr.first_difference(empty, empty.copy(), tr.VISIT_FIELDS) is None
