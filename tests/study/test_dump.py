"""The dump reader and writer against files built byte by byte with struct, not with write_dump."""

import errno
import os
import stat
import struct
import threading

import numpy as np
import pytest

from apa_emu.study.dump import Dump, DumpError, builtin_dump_path, read_dump, write_dump
from apa_emu.study.files import write_atomically

GOOD = dict(n=3, kv=5, nh=4, nkv=2, hd=64, off=2)


def _arrays(n, kv, nh, nkv, hd, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, nh, hd)).astype(np.float16)
    k = rng.standard_normal((kv, nkv, hd)).astype(np.float16)
    v = rng.standard_normal((kv, nkv, hd)).astype(np.float16)
    return q, k, v


def _file_bytes(n, kv, nh, nkv, hd, off, q=None, k=None, v=None):
    """The format spelled out by hand: six little-endian int32, then the FP16 values in C order."""
    if q is None:
        q, k, v = _arrays(max(n, 1), max(kv, 1), max(nh, 1), max(nkv, 1), max(hd, 1))
    values = [float(x) for t in (q, k, v) for x in t.ravel()]
    return struct.pack("<6i", n, kv, nh, nkv, hd, off) + struct.pack(f"<{len(values)}e", *values)


def _write(tmp_path, data, name="x.apadump"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_reads_hand_built_file(tmp_path):
    q, k, v = _arrays(3, 5, 4, 2, 64)
    path = _write(tmp_path, _file_bytes(**GOOD, q=q, k=k, v=v))
    d = read_dump(path)
    assert (d.n, d.kv, d.nh, d.nkv, d.hd, d.q_offset, d.group) == (3, 5, 4, 2, 64, 2, 2)
    assert d.q.dtype == np.float16 and d.q.shape == (3, 4, 64) and d.k.shape == d.v.shape == (5, 2, 64)
    np.testing.assert_array_equal(d.q, q)
    np.testing.assert_array_equal(d.k, k)
    np.testing.assert_array_equal(d.v, v)
    assert list(d.positions) == [2, 3, 4]
    assert d.nbytes == os.path.getsize(path)
    assert d.header() == GOOD
    assert d.path == path
    assert not d.q.flags.writeable


def test_opens_long_dump_without_reading_it(tmp_path):
    # A sparse 122880-key file: opening it must map, not read, its 500 MB.
    n, kv, nh, nkv, hd = 16, 122880, 24, 8, 128
    path = tmp_path / "long.apadump"
    with open(path, "wb") as f:
        f.write(struct.pack("<6i", n, kv, nh, nkv, hd, kv - n))
        f.truncate(24 + 2 * (n * nh * hd + 2 * kv * nkv * hd))
    d = read_dump(path, check_finite=False)
    assert isinstance(d.k, np.memmap) and d.k.shape == (kv, nkv, hd)
    assert float(d.v[-1, -1, -1]) == 0.0


@pytest.mark.parametrize("cut", [1, 2, 700])
def test_truncated(tmp_path, cut):
    data = _file_bytes(**GOOD)
    path = _write(tmp_path, data[:-cut])
    with pytest.raises(
        DumpError, match=rf"truncated \({cut} bytes missing\).*needs {len(data)} bytes.*has {len(data) - cut}"
    ):
        read_dump(path)


@pytest.mark.parametrize("extra", [1, 2, 4096])
def test_trailing_bytes(tmp_path, extra):
    data = _file_bytes(**GOOD)
    path = _write(tmp_path, data + b"\0" * extra)
    with pytest.raises(DumpError, match=rf"{extra} trailing bytes.*needs {len(data)} bytes"):
        read_dump(path)


@pytest.mark.parametrize("size", [0, 5, 23])
def test_shorter_than_header(tmp_path, size):
    path = _write(tmp_path, _file_bytes(**GOOD)[:size])
    with pytest.raises(DumpError, match="shorter than the 24-byte header"):
        read_dump(path)


def test_missing_file(tmp_path):
    with pytest.raises(DumpError, match="cannot open"):
        read_dump(tmp_path / "absent.apadump")


@pytest.mark.parametrize("field", ["n", "kv", "nh", "nkv", "hd"])
@pytest.mark.parametrize("value", [0, -1, -(2**31)])
def test_non_positive_header_field(tmp_path, field, value):
    header = dict(GOOD, **{field: value})
    path = _write(tmp_path, struct.pack("<6i", *header.values()) + b"\0" * 64)
    with pytest.raises(DumpError, match=rf"header: {field} = {value}: must be positive"):
        read_dump(path)


def test_negative_offset(tmp_path):
    header = dict(GOOD, off=-1)
    path = _write(tmp_path, struct.pack("<6i", *header.values()) + b"\0" * 64)
    with pytest.raises(DumpError, match="off = -1: must be non-negative"):
        read_dump(path)


def test_heads_not_a_multiple(tmp_path):
    q, k, v = _arrays(2, 4, 6, 4, 64)
    path = _write(tmp_path, _file_bytes(2, 4, 6, 4, 64, 0, q, k, v))
    with pytest.raises(DumpError, match="nh = 6 is not a multiple of nkv = 4"):
        read_dump(path)


@pytest.mark.parametrize("hd", [32, 96, 512])
def test_unsupported_head_dim(tmp_path, hd):
    q, k, v = _arrays(2, 4, 2, 1, hd)
    path = _write(tmp_path, _file_bytes(2, 4, 2, 1, hd, 0, q, k, v))
    with pytest.raises(DumpError, match=rf"hd = {hd}: supported head dims are 64, 128, 256"):
        read_dump(path)


def test_queries_past_last_key(tmp_path):
    q, k, v = _arrays(3, 5, 4, 2, 64)
    path = _write(tmp_path, _file_bytes(3, 5, 4, 2, 64, 3, q, k, v))
    with pytest.raises(DumpError, match=r"off \+ n = 3 \+ 3 exceeds kv = 5"):
        read_dump(path)


@pytest.mark.parametrize("tensor", ["Q", "K", "V"])
@pytest.mark.parametrize("bad", ["NaN", "Inf", "-Inf"])
def test_non_finite(tmp_path, tensor, bad):
    q, k, v = _arrays(3, 5, 4, 2, 64)
    target = {"Q": q, "K": k, "V": v}[tensor]
    target[2, 1, 7] = float(bad.lower())
    target[2, 1, 9] = np.nan  # a later bad value must not be the one reported
    path = _write(tmp_path, _file_bytes(**GOOD, q=q, k=k, v=v))
    with pytest.raises(DumpError, match=rf"{tensor} holds {bad.lstrip('-')} at index \[2, 1, 7\]"):
        read_dump(path)
    assert read_dump(path, check_finite=False).n == 3


def test_round_trip_matches_hand_built_bytes(tmp_path):
    q, k, v = _arrays(3, 5, 4, 2, 64, seed=3)
    path = write_dump(tmp_path / "w.apadump", q, k, v, 2)
    assert path.read_bytes() == _file_bytes(**GOOD, q=q, k=k, v=v)
    d = read_dump(path)
    for a, b in ((d.q, q), (d.k, k), (d.v, v)):
        np.testing.assert_array_equal(a, b)


def test_write_accepts_strided_arrays(tmp_path):
    q, k, v = _arrays(6, 5, 4, 2, 64)
    path = write_dump(tmp_path / "w.apadump", q[::2], k, v, 2)
    np.testing.assert_array_equal(read_dump(path).q, q[::2])


def test_write_replaces_atomically(tmp_path):
    path = tmp_path / "w.apadump"
    q, k, v = _arrays(3, 5, 4, 2, 64)
    write_dump(path, q, k, v, 2)
    before = path.read_bytes()
    with pytest.raises(DumpError):
        write_dump(path, q, k, v.astype(np.float32), 2)
    v_bad = v.copy()
    v_bad[0, 0, 0] = np.inf
    with pytest.raises(DumpError, match=r"v holds Inf at index \[0, 0, 0\]"):
        write_dump(path, q, k, v_bad, 2)
    assert path.read_bytes() == before
    write_dump(path, q[:1], k, v, 4)
    assert read_dump(path).header()["n"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.apadump"]


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=np.zeros((3, 4, 64), np.float32)), "q has dtype float32: dumps hold float16"),
        (dict(k=[[[0.0]]]), "k must be a numpy array"),
        (dict(v=np.zeros((5, 2, 64, 1), np.float16)), "v has shape .*expected 3 axes"),
        (dict(v=np.zeros((4, 2, 64), np.float16)), "k has shape .* but v has"),
        (dict(q=np.zeros((3, 4, 128), np.float16)), "q has head dim 128 but k has 64"),
        (dict(q=np.zeros((3, 3, 64), np.float16)), "nh = 3 is not a multiple of nkv = 2"),
        (dict(q_offset=3), r"off \+ n = 3 \+ 3 exceeds kv = 5"),
        (dict(q_offset=-1), "off = -1: must be non-negative"),
        (dict(q_offset=1.0), "q_offset must be an integer"),
    ],
)
def test_write_rejects_bad_arrays(tmp_path, change, message):
    q, k, v = _arrays(3, 5, 4, 2, 64)
    args = dict(q=q, k=k, v=v, q_offset=2)
    args.update(change)
    with pytest.raises(DumpError, match=message):
        write_dump(tmp_path / "w.apadump", **args)
    assert not any(tmp_path.iterdir())


def test_dump_validates_arrays():
    q, k, v = _arrays(3, 5, 4, 2, 64)
    with pytest.raises(DumpError, match=r"off \+ n = 3 \+ 3 exceeds kv = 5"):
        Dump(q, k, v, 3)
    assert Dump(q, k, v, np.int64(2)).q_offset == 2


def test_builtin_dump():
    d = read_dump(builtin_dump_path())
    assert d.header() == dict(n=512, kv=2048, nh=9, nkv=3, hd=64, off=1536)
    assert d.nbytes == 2162712
    # Real prefill attention: in float64, some head puts a large share of its mass on key 0 (the
    # sink) and another on the last 64 keys before each query (the diagonal).
    q, k = d.q.astype(np.float64), d.k.astype(np.float64)
    sink, diagonal = [], []
    for h in range(d.nh):
        s = q[:, h] @ k[:, h // d.group].T / np.sqrt(d.hd)
        s[np.arange(d.kv)[None, :] > d.positions[:, None]] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        sink.append(p[:, 0].mean())
        diagonal.append(np.mean([p[i, pos - 63 : pos + 1].sum() for i, pos in enumerate(d.positions)]))
    assert max(sink) > 0.4 and max(diagonal) > 0.3


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "f.apadump"
    os.mkfifo(fifo)
    outcome = []

    def read():
        try:
            read_dump(fifo)
        except DumpError as e:
            outcome.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # blocked in open(): release it by opening the write end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("read_dump blocked on a FIFO")
    assert outcome == [f"{fifo}: cannot open: a FIFO, not a regular file: refusing to read it"]


@pytest.mark.parametrize("special, kind", [("dir", "a directory"), ("/dev/null", "a character device")])
def test_non_regular_files_are_refused(tmp_path, special, kind):
    path = tmp_path if special == "dir" else special
    with pytest.raises(DumpError, match=f"{kind}, not a regular file"):
        read_dump(path)


def test_write_goes_through_symlinks(tmp_path):
    q, k, v = _arrays(3, 5, 4, 2, 64)
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "t.apadump"
    target.write_bytes(b"old")
    target.chmod(0o640)
    link = tmp_path / "link.apadump"
    link.symlink_to(target)
    write_dump(link, q, k, v, 2)
    assert link.is_symlink() and os.readlink(link) == str(target)
    np.testing.assert_array_equal(read_dump(target).q, q)
    assert target.stat().st_mode & 0o777 == 0o640
    dangling = tmp_path / "dangling.apadump"
    dangling.symlink_to(tmp_path / "real" / "new.apadump")
    write_dump(dangling, q, k, v, 2)
    assert dangling.is_symlink() and read_dump(tmp_path / "real" / "new.apadump").n == 3
    assert sorted(p.name for p in (tmp_path / "real").iterdir()) == ["new.apadump", "t.apadump"]


@pytest.mark.parametrize("kind", ["dir", "fifo", "link to fifo"])
def test_write_refuses_non_regular_targets(tmp_path, kind):
    q, k, v = _arrays(3, 5, 4, 2, 64)
    special = tmp_path / "special"
    if kind == "dir":
        special.mkdir()
    else:
        os.mkfifo(special)
    path = special
    if kind == "link to fifo":
        path = tmp_path / "link"
        path.symlink_to(special)
    with pytest.raises(OSError, match="not a regular file: refusing to replace it"):
        write_dump(path, q, k, v, 2)
    assert special.is_dir() if kind == "dir" else stat.S_ISFIFO(special.lstat().st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "w.apadump"
    path.write_bytes(b"old")

    def write(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(path, write)

    def full(f):
        f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left") as e:
        write_atomically(path, full)
    assert e.value.filename == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.apadump"] and path.read_bytes() == b"old"
