"""Engines: what runs a resolved call (apa_emu/call.py) and returns the emulator's Result.

The studies and ``apa check`` reach an implementation of numerics.md only through this interface:

- ``name``; what it implements: ``features`` (a subset of FEATURES, the call arguments it honours;
  without "warps" it computes every warp of a call that chooses some), ``head_dims``, and
  ``lacks(config, d)``, why it cannot run a config at head dim d (None: it can);
- ``missing()``: what this machine lacks to run it (None: nothing); it and ``lacks`` are asked of
  the class, before an engine is built;
- ``run(call, config, *, progress=None, **options) -> Result``, with ``options`` the keywords it
  declares in ``options`` (name -> choices), such as the kernel's launch schedules;
- where the studies keep its arrays: ``xp`` and ``put`` (the reference and metrics are computed
  there), ``block_elements``, ``free_memory()``, ``release()``, ``context()``, ``devices``; and,
  when it offers them, ``prep_arrays`` (its prep outputs, to localise a mismatch, apa_emu.compare).

and what ``apa check`` compares: ``bitexact`` (the engine claims numerics.md bit for bit: compared
bitwise, else in tolerance), ``config`` (the Config overrides it implements, e.g. "preset=seed") and
``recipe`` ("apa": numerics.md; else a peer kernel's recipe of apa_emu.peers, which it is compared
with, its ``run_peer`` then taking the place of ``run``). ``apa check`` passes an engine copies of its
inputs and fails one that changes them (``check_untouched``).

The emulator is the engine "cpu". Other packages register theirs as entry points of the group
``apa_emu.engines`` (``name = "module:Class"``), so that apa_emu never imports them; such a class is
built as ``cls(devices=..., note=...)``. A checkout that is not installed (on the device, a copy run with
PYTHONPATH) names them in ``$APA_ENGINES`` instead, in the same form: ``gpu=apa_gpu.engine:GpuEngine``,
several separated by commas. Wherever a name is taken, ``module:callable`` names one too.

The simplest engine is a function with ``apa_emu.attention``'s signature that returns a Result or just
the output array (docs/engines.md): ``wrap`` makes it an Engine, with what ``@engine(...)`` declared
on it. Result fields it does not return stay None and are not compared.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from importlib.metadata import EntryPoint, entry_points

import numpy as np

from . import api, arrays
from .call import Call
from .config import Config
from .geometry import HEAD_DIMS
from .result import Result

GROUP = "apa_emu.engines"
FEATURES = frozenset({"window", "paging", "varlen", "kv_state", "trace", "warps"})


class Engine:
    """An implementation that runs calls. ``note`` says why ``--backend auto`` chose it (or None);
    ``devices`` are the devices it runs on (empty: the current one; the studies run on several as
    workers of a cluster, each on the one it sees)."""

    name = ""
    features: frozenset = frozenset()
    head_dims: tuple[int, ...] = HEAD_DIMS
    bitexact = True  # the interface's contract; an approximate implementation says False
    recipe = "apa"  # what it implements: numerics.md (the emulator), or a peer recipe of apa_emu.peers
    config: tuple[str, ...] = ()  # the Config overrides it implements (Config.from_overrides)
    options: dict[str, tuple] = {}
    xp = np
    block_elements = 1 << 20  # float64 scores the studies compute at once where the arrays live
    prep_arrays = None
    wait = ""  # what a first run waits for (a compiler), said beside the studies' progress bar

    def __init__(self, *, devices=(), note: str | None = None):
        self.devices = tuple(devices)
        self.note = note

    @classmethod
    def missing(cls) -> str | None:
        """What this machine lacks to run the engine, in a few words (None: nothing)."""
        return None

    @classmethod
    def lacks(cls, config: Config, d: int) -> str | None:
        """Why the engine cannot run ``config`` at head dim ``d`` (None: it can)."""
        return None

    def run(self, call: Call, config: Config, *, progress=None, **options) -> Result:
        """The Result of a resolved call, bitwise the emulator's where the engine is exact, with NumPy
        arrays, or any DLPack arrays (torch tensors, on the host or a device), which ``apa check``
        brings to the host (``as_result``). ``progress(done, total)`` is called over ``steps`` steps."""
        raise NotImplementedError

    def steps(self, warps: int) -> int:
        """Progress steps of one call over ``warps`` warps."""
        return 1

    def put(self, x):
        """A host array where the engine computes (``xp``)."""
        return x

    def free_memory(self) -> list[tuple[int, int]]:
        """(device, free bytes) of each device the engine runs on; empty for host memory, which the
        emulator checks itself."""
        return []

    def release(self) -> None:
        """Give back the memory that earlier calls held."""

    def context(self):
        """The context the engine's calls run in (its device)."""
        return nullcontext()


def input_copy(x):
    """A copy of an engine's input array, where it lives (NumPy, CuPy or torch), for ``check_untouched``."""
    return None if x is None else x.clone() if hasattr(x, "clone") else x.copy()


def _host_bits(x) -> np.ndarray:
    a = np.asarray(x.get() if hasattr(x, "get") else x.detach().cpu() if hasattr(x, "detach") else x)
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}") if a.dtype.kind in "fc" else a


def check_untouched(name: str, originals: dict, given: dict) -> None:
    """An EngineError of one line when the engine changed an input in place: ``given`` (name ->
    the copy it was passed) against ``originals``, bit for bit, wherever the arrays live."""
    for key, original in originals.items():
        if original is None or given.get(key) is None:
            continue
        a, b = _host_bits(original), _host_bits(given[key])
        if a.shape != b.shape or not np.array_equal(a, b):
            where = "" if a.shape != b.shape else f" (first at index {tuple(int(i) for i in np.argwhere(a != b)[0])})"
            raise EngineError(f"engine {name} modified its input {key} in place{where}; an engine must leave "
                              f"its inputs unchanged")


class CpuEngine(Engine):
    """The emulator (apa_emu.api.run), ``workers`` processes over the warps of each (batch, KV head)."""

    name = "cpu"
    features = FEATURES
    wait = "the first run compiles the emulator with Numba, about 30 s"

    def __init__(self, workers: int = 1, note: str | None = None):
        super().__init__(note=note)
        self.workers = workers

    def run(self, call, config, *, progress=None):
        return api.run(call, config, workers=self.workers, progress=progress)

    def steps(self, warps):
        return warps


class EngineError(ValueError):
    """An engine that cannot be loaded, or did something the interface does not allow; the message is
    one line naming the engine and what it did."""


class EngineInterrupt(KeyboardInterrupt):
    """A KeyboardInterrupt out of an engine's own code, named like an EngineError. It stays an
    interrupt, since a user's Ctrl-C lands in whatever code runs; the ``apa`` command, which sees the
    signal arrive, tells the two apart."""


@contextmanager
def guarded(words: str, *, errors: bool = True):
    """Run an engine's own code (its import, construction or call): what it raises leaves as one line,
    ``words`` then the exception's type and first line. SystemExit and the other exceptions outside
    Exception become an EngineError, so that a sys.exit(0) in an engine never ends a check as a
    silent pass, and a KeyboardInterrupt an EngineInterrupt. ``errors``: whether an Exception becomes
    an EngineError too (False: it passes as it is, to handlers that word the errors of known engines)."""
    try:
        yield
    except (EngineError, EngineInterrupt):
        raise
    except KeyboardInterrupt as e:
        raise EngineInterrupt(f"{words} {type(e).__name__}: {_first_line(e)}") from e
    except Exception as e:
        if not errors:
            raise
        raise EngineError(f"{words} {type(e).__name__}: {_first_line(e)}") from e
    except BaseException as e:  # SystemExit above all: an engine that exits has failed
        raise EngineError(f"{words} {type(e).__name__}: {_first_line(e)}") from e


def engine(name: str | None = None, *, features=(), head_dims=HEAD_DIMS, bitexact: bool = False, config=()):
    """Declare what a function engine implements (``wrap`` reads it): its ``name`` (default: the
    function's), the ``features`` it honours (of FEATURES), its ``head_dims``, whether it claims
    numerics.md bit for bit, and the ``config`` overrides it implements ("preset=seed", "eps=0")."""
    unknown = sorted(set(features) - FEATURES)
    if unknown:
        raise EngineError(f"engine {name or '?'}: unknown features {', '.join(unknown)} "
                          f"(known: {', '.join(sorted(FEATURES))})")

    def declare(fn):
        called = name or getattr(fn, "__name__", "?")
        if isinstance(head_dims, (str, bytes)) or not isinstance(head_dims, Iterable) or not set(head_dims) or \
                not set(head_dims) <= set(HEAD_DIMS):
            raise EngineError(f"engine {called}: head_dims={head_dims!r}: expected some of {HEAD_DIMS} (the head "
                              f"dims numerics.md defines)")
        if not (isinstance(config, str) or isinstance(config, Iterable) and all(isinstance(c, str) for c in config)):
            raise EngineError(f"engine {called}: config={config!r}: expected Config overrides, e.g. 'preset=seed' "
                              f"or ['eps=0']")
        fn.apa_engine = _declaration(name or fn.__name__, features, head_dims, bitexact, config)
        return fn

    return declare


def _declaration(name, features=(), head_dims=HEAD_DIMS, bitexact=False, config=()) -> dict:
    return dict(name=name, features=frozenset(features), head_dims=tuple(head_dims), bitexact=bool(bitexact),
                config=(config,) if isinstance(config, str) else tuple(config))


# the keywords of attention each feature passes to a function engine
_KEYWORDS = {"window": ("window",), "paging": ("block_table", "seqlen_k"), "varlen": ("cu_seqlens_q", "cu_seqlens_k"),
             "kv_state": ("kv_state",), "trace": ("trace",), "warps": ("warps",)}


class FunctionEngine(Engine):
    """A function with ``apa_emu.attention``'s signature as an Engine: each call's arguments as the
    user passed them, the keywords left at their defaults not passed at all."""

    function = None  # set by wrap, a staticmethod

    def run(self, call, config, *, progress=None):
        args, kwargs = call_arguments(call)
        # without "warps" it computes every warp, without "trace" it returns no records: both allowed;
        # a problem it does not implement is not
        kwargs = {key: value for key, value in kwargs.items() if key not in ("warps", "trace") or key in self.features}
        for feature in sorted(FEATURES - self.features - {"warps", "trace"}):
            if any(key in kwargs for key in _KEYWORDS[feature]):
                raise EngineError(f"engine {self.name} does not implement {feature} (it declares "
                                  f"{', '.join(sorted(self.features)) or 'no feature'})")
        with guarded(f"engine {self.name} raised"):
            res = type(self).function(*args, config, **kwargs)
        if progress:
            progress(1, 1)
        return as_result(self.name, res, call, config)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "(no message)"


def wrap(fn, name: str | None = None) -> type[Engine]:
    """An Engine class running ``fn`` (see FunctionEngine), with what ``@engine`` declared on it."""
    decl = dict(getattr(fn, "apa_engine", None) or _declaration(getattr(fn, "__name__", "engine")))
    decl["name"] = name or decl["name"]
    _check_keywords(fn, decl["name"], decl["features"])
    return type(f"FunctionEngine_{decl['name']}", (FunctionEngine,), dict(function=staticmethod(fn), **decl))


def _check_keywords(fn, name: str, features) -> None:
    """A feature claimed by a function that cannot take its keyword is refused now, in one line, not
    as a TypeError on the first call that passes it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or an extension without a signature: trust the claim
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    for feature in sorted(features):
        missing = [k for k in _KEYWORDS[feature] if k not in params]
        if missing:
            raise EngineError(f"engine {name} claims {feature!r} but its function takes no {missing[0]}= argument")


def call_arguments(call: Call) -> tuple[tuple, dict]:
    """The positional (q, k, v, q_offset) and keyword arguments of ``attention`` that make ``call``:
    only the keywords the call uses, so that a plain ``f(q, k, v, q_offset, config)`` runs a dense call."""
    s = call.shape
    kw = {}
    if call.seqs is not None:
        q, k, v = call.q[0], call.k[0], call.v[0]
        kw.update(cu_seqlens_q=call.seqs.cq, cu_seqlens_k=call.seqs.ck)
        offset = 0
    else:
        q = call.q[0] if call.squeeze else call.q
        paged = call.pages is not None
        k, v = (x if paged or not call.squeeze else x[0] for x in (call.k, call.v))
        if paged:
            kw.update(block_table=call.pages.table[0] if call.squeeze else call.pages.table, seqlen_k=call.pages.S)
        offset = s.q_offset
    trace = None if call.want is None else "all" if call.want.warps is None else sorted(call.want.warps)
    kw.update(window=s.window, kv_state=call.kv_state, trace=trace,
              warps=None if call.warps is None else sorted(call.warps))
    return (q, k, v, offset), {key: value for key, value in kw.items() if value is not None}


def as_result(name: str, res, call: Call, config: Config) -> Result:
    """An engine's return value as a Result: a Result, or the output array alone (the other fields
    None: not compared), its arrays NumPy or any DLPack arrays (a torch tensor, on a device too),
    brought to the host as NumPy. Anything else, or an output not of q's shape and dtype float16, is
    an EngineError naming the engine."""
    q_shape = call.q.shape[1:] if call.squeeze or call.seqs is not None else call.q.shape  # a varlen q is packed
    if isinstance(res, Result):
        out = res.out
    elif arrays.speaks_dlpack(res) or hasattr(res, "__array__") and hasattr(res, "shape"):  # NumPy speaks DLPack
        out, res = res, None
    else:
        raise EngineError(f"engine {name} returned a {type(res).__name__}, expected a Result or the output array")
    if not hasattr(out, "shape") or not hasattr(out, "dtype"):
        raise EngineError(f"engine {name} returned an out of type {type(out).__name__}, expected an array")
    if tuple(out.shape) != tuple(q_shape):
        raise EngineError(f"engine {name} returned an output of shape {tuple(out.shape)}, expected q's {tuple(q_shape)}")
    host = _on_host(out)
    if getattr(host, "dtype", None) != np.float16:
        raise EngineError(f"engine {name} returned an output of dtype {out.dtype}, expected float16 (the output "
                          f"attention returns)")
    out = np.asarray(host)
    if res is not None:
        res = dataclasses.replace(res, **{field: _on_host(getattr(res, field)) for field in _ARRAY_FIELDS})
        _check_fields(name, res, tuple(out.shape[:-1]))
    if res is None:  # every field the engine did not return is None, whatever fields Result gains
        absent = {f.name: None for f in dataclasses.fields(Result)
                  if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        return Result(**{**absent, "out": out, "config": config})
    return dataclasses.replace(res, out=out)


def _on_host(value):
    """An engine's array on the host, a NumPy array where DLPack imports it (a torch tensor, on a
    device too); else as it was, for the checks to name what it is."""
    try:
        return arrays.host("", value, "")
    except ValueError:
        return value


_ARRAY_FIELDS = ("err_bound", "err_est", "hot", "visits", "rows")


def _check_fields(name: str, res: Result, pairs: tuple) -> None:
    """A returned Result's other fields, each None or of its kind: per-pair binary32 arrays of out's
    shape less its last axis, a hot-mask array of (b, hk, warp, word), §10's structured records and
    integer tile counts; else an EngineError naming the field (the studies index them all)."""
    for field in ("active_tiles", "hot_tiles"):
        value = getattr(res, field)
        if value is not None and (not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_))):
            raise EngineError(f"engine {name} returned {field}={value!r}, expected an integer (or None)")
    for field, kind in zip(_ARRAY_FIELDS, ("f", "f", "iu", "V", "V")):
        value = getattr(res, field)
        if value is None:
            continue
        dtype = getattr(value, "dtype", None)
        if not hasattr(value, "shape") or getattr(dtype, "kind", None) not in tuple(kind):  # a torch dtype has none
            raise EngineError(f"engine {name} returned {field} of type {type(value).__name__}"
                              f"{f' and dtype {dtype}' if dtype is not None else ''}, expected "
                              f"{_KINDS[kind]} (or None)")
        if kind == "f" and tuple(value.shape) != pairs or kind == "iu" and len(value.shape) != 4:
            raise EngineError(f"engine {name} returned {field} of shape {tuple(value.shape)}, expected "
                              f"{pairs if kind == 'f' else 'four axes (b, hk, warp, word)'}")


_KINDS = {"f": "a float array", "iu": "an integer array", "V": "§10's structured records"}


def _import(spec: str):
    """``module:callable``, imported; EngineError in one line when it does not import."""
    module, _, attr = spec.partition(":")
    with guarded(f"engine {spec}: cannot import {module}:"):
        obj = importlib.import_module(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EngineError(f"engine {spec}: module {module} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


def _engine_class(spec: str, obj) -> type[Engine]:
    """An Engine class as it is, a function wrapped; any other class, or the interface itself (Engine,
    FunctionEngine, which run nothing and have no name), is an EngineError."""
    if isinstance(obj, type):
        if not issubclass(obj, Engine):
            raise EngineError(f"engine {spec}: class {obj.__qualname__} is not an apa_emu Engine (subclass "
                              f"apa_emu.engines.Engine, or name a function with attention's signature)")
        if obj in (Engine, FunctionEngine):
            raise EngineError(f"engine {spec}: class {obj.__qualname__} is the Engine interface, which runs "
                              f"nothing (subclass it with a run, or name a function)")
        return obj
    if callable(obj):
        return wrap(obj, name=None if hasattr(obj, "apa_engine") else spec)
    raise EngineError(f"engine {spec}: a {type(obj).__name__} is neither an Engine class nor a function")


def _named() -> dict[str, EntryPoint]:
    """The engines of other packages: their entry points, then those of ``$APA_ENGINES``."""
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    for item in filter(None, (s.strip() for s in os.environ.get("APA_ENGINES", "").split(","))):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not re.fullmatch(r"\s*[\w.]+:[\w.]+\s*", value):
            raise ValueError(f"APA_ENGINES: {item!r} is not name=module:Class")
        found[name.strip()] = EntryPoint(name.strip(), value.strip(), GROUP)
    return found


def registered() -> tuple[str, ...]:
    """The names of the engines registered by other packages, without importing them."""
    return tuple(sorted(set(_named()) - {"auto", "cpu"}))


def is_spec(name: str) -> bool:
    """Whether ``name`` is a ``module:callable`` rather than an engine's name."""
    return ":" in name


def load(name: str) -> type[Engine]:
    """The engine class called ``name``: "cpu", a registered one (KeyError otherwise), or a
    ``module:callable`` (an Engine class, or a function wrapped by ``wrap``; EngineError when it does
    not import)."""
    if name == "cpu":
        return CpuEngine
    if is_spec(name):
        return _engine_class(name, _import(name))
    ep = _named().get(name)
    if ep is None:
        raise KeyError(f"no engine {name!r} (engines: {', '.join(('cpu',) + registered())})")
    source = "$APA_ENGINES" if getattr(ep, "dist", None) is None else f"package {ep.dist.name}"
    with guarded(f"engine {name} (registered by {source}): cannot load {ep.value}:"):
        obj = ep.load()
    return _engine_class(name, obj)
