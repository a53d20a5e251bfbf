"""What the real-model dump makers (``smollm2``, ``gemma3``) share: optional imports named with their
pip command, the GGUF metadata reader, the hyperparameters, the tokens in and out of the vocabulary,
the RoPE tables, the text argument and its shipped samples, the checks made before a forward pass
and the FP16 dump writing after it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dump import write_dump
from .files import read_text

MODELS_EXTRA = "pip install 'apa-emu[models]'"
F16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class HParams:
    """A decoder's shape, as its GGUF metadata gives it."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx: int
    rope_base: float
    rms_eps: float


class TextModel:
    """What a model does alike on either side of its forward pass: ``tokenize`` with its GGUF's
    ``tokenizer`` (``bos_id`` first, unless None), ``detokenize``, the token checks of ``forward``
    and the perplexity of its ``token_nll``."""

    def tokenize(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return np.asarray(ids, dtype=np.int64)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def checked_tokens(self, tokens) -> np.ndarray:
        """``tokens`` as int64, refused unless a non-empty 1-D sequence of the vocabulary's ids."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {tokens.shape}")
        if tokens.min() < 0 or tokens.max() >= self.embd.shape[0]:
            raise ValueError(f"tokens must lie in 0..{self.embd.shape[0] - 1}")
        return tokens

    def perplexity(self, tokens) -> float:
        return float(np.exp(self.token_nll(tokens).mean()))


def data_path(name: str) -> Path:
    """A file shipped in the package's data folder (apa_emu/study/data/README.md)."""
    return Path(__file__).resolve().parent / "data" / name


def require(module: str, who: str, pip: str = MODELS_EXTRA):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{who} needs the optional package {module!r}: {pip}") from e


def open_gguf(path: Path, arch: str, who: str):
    """``(gguf, reader, value)`` for a GGUF of architecture ``arch``: ``value(key, default=None)``
    returns a metadata value, the default when the key is missing, or raises naming the key."""
    gguf = require("gguf", who)
    reader = gguf.GGUFReader(str(path))
    meta = reader.fields

    def value(key, default=None):
        if key in meta:
            return meta[key].contents()
        if default is None:
            raise ValueError(f"{path}: GGUF metadata {key!r} is missing")
        return default

    found = value("general.architecture")
    if found != arch:
        raise ValueError(f"{path}: general.architecture = {found!r}: only {arch!r} is supported")
    return gguf, reader, value


def dequantized(gguf, reader) -> dict[str, np.ndarray]:
    """Every tensor as a writable float32 array: float32 tensors are copied out of the read-only map
    (torch refuses to wrap a read-only array)."""
    return {t.name: np.require(gguf.quants.dequantize(t.data, t.tensor_type), np.float32, "W") for t in reader.tensors}


def rope_tables(T: int, d: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, 1, d] of rotate-half RoPE (channel i pairs with channel i + d/2), float32."""
    # Angles in float64: at position 8191 a float32 product would be off in its last bits.
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=1)[:, None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def text_of(text_or_path: str | Path | None, default: Path) -> str:
    """A ``Path`` is read as UTF-8, a ``str`` is the text itself, None is ``default``."""
    if isinstance(text_or_path, Path) or text_or_path is None:
        return read_text(text_or_path or default)
    if isinstance(text_or_path, str):
        return text_or_path
    raise TypeError(f"text_or_path must be a str (the text), a Path or None, got {type(text_or_path).__name__}")


def dump_tokens(model, text: str, layers, n_query: int, max_tokens: int, out_dir: str | Path):
    """The checks before a dump's forward pass, so that a bad argument fails before minutes of work:
    ``(tokens, layers, out_dir)`` with the text's first ``max_tokens`` tokens, the sorted distinct
    layers and the output folder, created."""
    layers = sorted(set(int(x) for x in layers))
    if not layers:
        raise ValueError("layers is empty: name at least one layer")
    n_layer = model.hp.n_layer
    bad = [x for x in layers if not 0 <= x < n_layer]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has layers 0..{n_layer - 1}")
    tokens = model.tokenize(text)[:max_tokens]
    if not 1 <= n_query <= tokens.size:
        raise ValueError(
            f"n_query = {n_query}: must be in 1..{tokens.size}, the number of tokens taken from the text "
            f"(max_tokens = {max_tokens})"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return tokens, layers, out_dir


def write_layer_dumps(model_name: str, captured: dict, n_query: int, out_dir: Path) -> list[Path]:
    """One dump per captured layer (Q [T, nh, hd], K and V [T, nkv, hd] in float32): the last
    ``n_query`` Q rows against all T keys, cast to FP16, named ``{model_name}_L{layer}_kv{T}_n{n_query}``.
    A value past the FP16 range raises OverflowError naming the layer and tensor: a cast would turn
    it into inf."""
    paths = []
    for layer in sorted(captured):
        q, k, v = captured[layer]
        T = k.shape[0]
        tensors = {"Q": q[T - n_query :], "K": k, "V": v}
        for name, x in tensors.items():
            peak = float(np.abs(x).max())
            if peak > F16_MAX:
                raise OverflowError(f"layer {layer}: {name} reaches |x| = {peak:.6g}, past the FP16 maximum 65504")
        q16, k16, v16 = (x.astype(np.float16) for x in tensors.values())
        path = out_dir / f"{model_name}_L{layer}_kv{T}_n{n_query}.apadump"
        paths.append(write_dump(path, q16, k16, v16, T - n_query))
    return paths
