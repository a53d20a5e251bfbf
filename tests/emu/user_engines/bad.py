"""Engines that break the interface, each in one way, for the one-line messages of apa check, and one
that claims a config."""

import numpy as np

import apa_emu
from apa_emu.engines import engine


def raises(q, k, v, q_offset=0, config=None):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def wrong_shape(q, k, v, q_offset=0, config=None):
    return np.zeros(q.shape[:-1], np.float16)


def wrong_dtype(q, k, v, q_offset=0, config=None):
    return np.zeros(q.shape, np.float32)


def nan(q, k, v, q_offset=0, config=None):
    out = apa_emu.attention(q, k, v, q_offset, config).out
    out[..., 3, 1, 5] = np.nan
    return out


def not_an_array(q, k, v, q_offset=0, config=None):
    return [1, 2, 3]


@engine(name="claims-trace", features={"trace"}, bitexact=True)
def claims_trace(q, k, v, q_offset=0, config=None, trace=None):
    return apa_emu.attention(q, k, v, q_offset, config).out


@engine(name="claims-window", features={"window"})
def claims_window(q, k, v, q_offset=0, config=None):
    return apa_emu.attention(q, k, v, q_offset, config).out


@engine(name="seed-like", bitexact=True, config="preset=seed")
def seed_like(q, k, v, q_offset=0, config=None):
    """A kernel of the seed's arithmetic (numerics.md §12): the config it claims is the one it runs."""
    return apa_emu.attention(q, k, v, q_offset, config).out
