"""Engines a careless or hostile user might write, each wrong in one way the interface names in one
line: a class that is not an Engine, one whose constructor raises, Results with ill-typed fields, and
one declaring a head dim the dumps lack."""

import dataclasses

import numpy as np

import apa_emu
from apa_emu.engines import Engine, engine


class NotEngine:
    def __init__(self, *a, **kw):
        pass


class BadInit(Engine):
    name = "bad-init"

    def __init__(self, **kw):
        raise RuntimeError("cannot build")

    def run(self, call, config, *, progress=None):
        raise AssertionError("never built")


def _res(q, k, v, q_offset, config, trace=None, **fields):
    return dataclasses.replace(apa_emu.attention(q, k, v, q_offset, config, trace=trace), **fields)


@engine(bitexact=True)
def str_hot(q, k, v, q_offset=0, config=None):
    return _res(q, k, v, q_offset, config, hot="hot")


def flat_bound(q, k, v, q_offset=0, config=None):
    return _res(q, k, v, q_offset, config, err_bound=np.zeros(3, np.float32))


def list_est(q, k, v, q_offset=0, config=None):
    return _res(q, k, v, q_offset, config, err_est=[1, 2, 3])


def float_tiles(q, k, v, q_offset=0, config=None):
    return _res(q, k, v, q_offset, config, hot_tiles=1.5)


@engine(features={"trace"}, bitexact=True)
def plain_visits(q, k, v, q_offset=0, config=None, trace=None):
    return _res(q, k, v, q_offset, config, trace, visits=np.zeros(3, np.int8), rows=np.zeros(2, np.int8))


@engine(head_dims=(128,))
def only_128(q, k, v, q_offset=0, config=None):
    return apa_emu.attention(q, k, v, q_offset, config).out
