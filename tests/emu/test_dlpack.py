"""Torch tensors (any DLPack array) in and out of ``attention`` (apa_emu/arrays.py): the same bits as
the NumPy call, the caller's kind of array back, no copy where the layout allows, one line for each bad
input; and an engine that returns torch tensors is compared like one that returns NumPy arrays. The
oracle is the NumPy call itself: the DLPack path must not change a bit of it."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest

import apa_emu
import apa_gpu
from apa_emu import Config, arrays
from apa_emu.engines import EngineError, engine
from apa_emu.problems import Problem
from apa_emu.result import Result
from apa_emu.testing import assert_matches_emulator

torch = pytest.importorskip("torch")

PROBLEMS = {
    "dense": Problem(seed=1, B=1, n=40, Hkv=1, G=2, d=64, S=100, structure="normal", batched=False, q_offset=60),
    "batched GQA window": Problem(seed=2, B=2, n=20, Hkv=2, G=3, d=128, S=150, structure="sink", batched=True,
                                  q_offset=130, window=70),
    "paged": Problem(seed=3, B=2, n=16, Hkv=1, G=2, d=64, S=130, structure="normal", batched=True, q_offset=114,
                     page_size=32),
    "varlen": Problem(seed=4, B=1, n=30, Hkv=1, G=2, d=64, S=120, structure="outliers", batched=False,
                      seqlens=((10, 50), (20, 70))),
}
PER_PAIR = ("out", "err_bound", "err_est", "hot")
rng = np.random.default_rng(0)
Q = rng.standard_normal((64, 2, 64)).astype(np.float16)
K = rng.standard_normal((128, 1, 64)).astype(np.float16)
V = rng.standard_normal((128, 1, 64)).astype(np.float16)


def _torch(x):
    """A NumPy argument as a CPU torch tensor of its own memory; anything else as it is."""
    return torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x


def _same_bits(got, want) -> None:
    for name in PER_PAIR:
        g, w = getattr(got, name), getattr(want, name)
        assert isinstance(g, torch.Tensor) and g.device.type == "cpu", (name, type(g))
        assert g.numpy().tobytes() == w.tobytes() and tuple(g.shape) == w.shape, name
    for name in ("visits", "rows"):  # §10's records: structured, which DLPack cannot carry
        assert isinstance(getattr(got, name), np.ndarray) and getattr(got, name).tobytes() == getattr(want, name).tobytes()
    assert (got.active_tiles, got.hot_tiles) == (want.active_tiles, want.hot_tiles)


@pytest.mark.parametrize("name", PROBLEMS)
def test_torch_cpu_tensors_give_the_numpy_bits_as_torch_tensors(name):
    args, kwargs = PROBLEMS[name].arguments()
    want = apa_emu.attention(*args, trace="all", **kwargs)
    got = apa_emu.attention(*map(_torch, args), trace="all", **{key: _torch(x) for key, x in kwargs.items()})
    _same_bits(got, want)


def test_a_strided_tensor_and_one_that_requires_grad_are_read_as_their_values():
    """A non-contiguous q (heads first in memory) and a k that requires grad: the same bits, and the
    caller's tensors untouched (k still requires grad; no output does)."""
    want = apa_emu.attention(Q, K, V, 64, trace="all")
    q = torch.from_numpy(np.ascontiguousarray(Q.transpose(1, 0, 2))).permute(1, 0, 2)
    k = torch.from_numpy(K.copy()).requires_grad_(True)
    assert not q.is_contiguous()
    got = apa_emu.attention(q, k, torch.from_numpy(V), 64, trace="all")
    _same_bits(got, want)
    assert k.requires_grad and not any(getattr(got, name).requires_grad for name in PER_PAIR)


def test_the_conversion_shares_memory_both_ways():
    """A contiguous float16 CPU tensor is read in place, and a result array goes back in place."""
    t = torch.from_numpy(Q.copy())
    a = arrays.imported("q", t, "dtype float16")
    assert isinstance(a, np.ndarray) and a.ctypes.data == t.data_ptr() and np.shares_memory(a, t.numpy())
    call = apa_emu.call.resolve_call(t, torch.from_numpy(K), torch.from_numpy(V), 64)
    assert np.shares_memory(call.q, t.numpy())
    out = np.zeros((3, 4), np.float16)
    back = arrays.like(t)(out)
    assert isinstance(back, torch.Tensor) and back.data_ptr() == out.ctypes.data
    assert arrays.like(Q) is None  # NumPy in: the Result itself, unchanged


class _OnCuda:
    """An array that says it lives on CUDA device 0 (no GPU needed to be refused)."""

    dtype = "float16"
    shape = (128, 1, 64)

    def __dlpack__(self, **kwargs):
        raise BufferError("no device here")

    def __dlpack_device__(self):
        return 2, 0


BAD = [
    (lambda: (torch.from_numpy(Q).bfloat16(), K, V),
     r"q: expected dtype float16, got torch\.bfloat16 \(DLPack: [^\n]+\)"),
    (lambda: (torch.from_numpy(Q).float(), K, V), r"q: expected dtype float16, got float32"),
    (lambda: (Q, [[0.0]], V), r"k: expected a NumPy or DLPack array, got list"),
    (lambda: (Q, torch.from_numpy(K).to(torch.int16), V), r"k: expected dtype float16, got int16"),
]


@pytest.mark.parametrize("attention", [apa_emu.attention, apa_gpu.attention])
@pytest.mark.parametrize("bad", range(len(BAD)))
def test_each_bad_input_is_one_line_and_the_same_for_both_engines(attention, bad):
    inputs, message = BAD[bad]
    with pytest.raises(ValueError) as e:
        attention(*inputs(), 64)
    assert "\n" not in str(e.value) and re.fullmatch(message, str(e.value)), str(e.value)


def test_a_device_array_is_refused_by_the_emulator_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"^k: an array on cuda:0; apa_emu\.attention runs on the host: pass a "
                                         r"host array \(torch: x\.cpu\(\)\), or run it on the GPU with "
                                         r"apa_gpu\.attention$"):
        apa_emu.attention(torch.from_numpy(Q), _OnCuda(), V, 64)
    monkeypatch.setitem(sys.modules, "cupy", None)  # the kernel's launcher reads it through CuPy
    with pytest.raises(ValueError, match=r"^k: an array on cuda:0 needs CuPy to be read \(pip install "):
        apa_gpu.attention(Q, _OnCuda(), V, 64)


@engine(name="torch-out", bitexact=True)
def _torch_out(q, k, v, q_offset=0, config=None):
    return torch.from_numpy(apa_emu.attention(q, k, v, q_offset, config).out)


@engine(name="torch-result", bitexact=True, features={"trace"})
def _torch_result(q, k, v, q_offset=0, config=None, trace=None):
    res = apa_emu.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), q_offset, config,
                            trace=trace)
    assert isinstance(res.out, torch.Tensor) and isinstance(res.hot, torch.Tensor)
    return res


def test_an_engine_returning_torch_tensors_is_checked_bitwise():
    problem = Problem(seed=5, B=2, n=20, Hkv=2, G=3, d=64, S=150, structure="sink", batched=True, q_offset=130)
    for fn in (_torch_out, _torch_result):
        outcome = assert_matches_emulator(fn, problem, Config())
        assert outcome.passed and outcome.mode == "bitwise"


def test_an_engine_returning_a_wrong_torch_dtype_or_field_is_one_line():
    def bf16(q, k, v, q_offset=0, config=None):
        return torch.zeros(q.shape, dtype=torch.bfloat16)

    def bad_bound(q, k, v, q_offset=0, config=None):
        res = apa_emu.attention(q, k, v, q_offset, config)
        return Result(out=torch.from_numpy(res.out), err_bound=torch.zeros(res.err_bound.shape, dtype=torch.bfloat16),
                      hot=None, active_tiles=None, hot_tiles=None, config=config)

    problem = ((Q, K, V, 64), {})
    with pytest.raises(EngineError, match=r"^engine bf16 returned an output of dtype torch\.bfloat16, expected "
                                          r"float16 \(the output attention returns\)$"):
        assert_matches_emulator(bf16, problem)
    with pytest.raises(EngineError, match=r"^engine bad_bound returned err_bound of type Tensor and dtype "
                                          r"torch\.bfloat16, expected a float array \(or None\)$"):
        assert_matches_emulator(bad_bound, problem)


@pytest.mark.gpu
def test_the_kernel_takes_and_returns_torch_cpu_tensors():
    args, kwargs = PROBLEMS["dense"].arguments()
    want = apa_gpu.attention(*args, trace="all", **kwargs)
    got = apa_gpu.attention(*map(_torch, args), trace="all", **kwargs)
    _same_bits(got, want)


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device here")
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.hardware
@pytest.mark.gpu
@pytest.mark.parametrize("name", PROBLEMS)
def test_cuda_tensors_through_the_kernel_give_the_numpy_bits_as_cuda_tensors(name):
    dev = _cuda()
    args, kwargs = PROBLEMS[name].arguments()
    on = lambda x: _torch(x).to(dev) if isinstance(x, np.ndarray) else x  # noqa: E731
    want = apa_gpu.attention(*args, trace="all", **kwargs)
    got = apa_gpu.attention(*map(on, args), trace="all", **{key: on(x) for key, x in kwargs.items()})
    for field in PER_PAIR:
        g = getattr(got, field)
        assert isinstance(g, torch.Tensor) and g.device == dev, (field, type(g))
        assert g.cpu().numpy().tobytes() == getattr(want, field).tobytes(), field
    with pytest.raises(ValueError, match=r"^q: an array on cuda:\d+; apa_emu\.attention runs on the host"):
        apa_emu.attention(*map(on, args), **kwargs)


@pytest.mark.hardware
@pytest.mark.gpu
def test_an_engine_returning_cuda_tensors_is_checked_bitwise():
    dev = _cuda()

    @engine(name="cuda-out", bitexact=True)
    def cuda_out(q, k, v, q_offset=0, config=None):
        return apa_gpu.attention(*(torch.from_numpy(x).to(dev) for x in (q, k, v)), q_offset, config).out

    assert assert_matches_emulator(cuda_out, ((Q, K, V, 64), {})).passed
