"""The files the study tools read and write: regular files only, and writes that land whole or not at all.

A FIFO opened for reading blocks until a writer appears, and replacing a device node or a symlink
with a new file destroys what the user pointed at; both were real failures of ``apa``.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(mode: int, path, action: str) -> OSError:
    """The error for a path of this ``mode`` that is not a regular file, naming what it is."""
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return OSError(errno.EINVAL, f"{kind}, not a regular file: refusing to {action} it", str(path))


@contextmanager
def open_regular(path: str | os.PathLike):
    """Open a regular file for binary reading; anything else raises OSError naming what it is.

    O_NONBLOCK makes opening a FIFO return at once, so the check on the open descriptor is
    race-free and never hangs."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(mode, path, "read")
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_text(path: str | os.PathLike) -> str:
    with open_regular(path) as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def write_atomically(path: str | os.PathLike, write) -> Path:
    """Create or replace the regular file at ``path`` with what ``write(f)`` writes to a binary file.

    The bytes go to a temporary file beside the target, which is renamed over it only when whole:
    readers see the old file or the new one, and a failure or Ctrl-C leaves no partial file. A symlink
    is written through (its target is replaced, the link stays); a directory, device, FIFO or socket is
    refused. A replaced file keeps its permission bits.
    """
    path = Path(path)
    target = Path(os.path.realpath(path))
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise not_regular(mode, path, "replace")
    # A unique name opened exclusively, not mkstemp: the file gets the umask's permissions, not 0600.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, stat.S_IMODE(mode))
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        # write() and fsync() errors carry no file name: name the target the user gave
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
