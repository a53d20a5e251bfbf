"""What ``--cluster`` and ``--devices`` name (``Spec``), the GPUs a local cluster's workers get, and
Dask, imported only when a cluster is asked for (it is the ``cluster`` extra)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

INSTALL = "pip install -e '.[cluster]'"
MISSING = f"--cluster runs the study on Dask, which is not installed: {INSTALL}"


@dataclass(frozen=True)
class Spec:
    """Where the units run: a running scheduler's ``address``, or a local cluster of ``workers``
    (None: one per GPU, else one per CPU) on ``gpus`` (None: the GPUs there are; --devices)."""

    address: str | None = None
    workers: int | None = None
    gpus: tuple[int, ...] | None = None

    def __str__(self) -> str:
        if self.address:
            return self.address
        if self.gpus is not None:
            return f"local on GPUs {','.join(map(str, self.gpus))}"
        return "local" + (f":{self.workers}" if self.workers else "")


def within_cpus(requested: int, option: str) -> int:
    """``requested`` processes, at most the CPUs this process may use (a note on stderr when fewer):
    more would only contend for them, and a mistyped count would start a process storm."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if requested <= cpus:
        return requested
    print(f"apa: note: {option} is more than the {cpus} CPUs available: using {cpus}", file=sys.stderr)
    return cpus


def parse(text: str) -> Spec:
    """``--cluster``'s spellings: local, local:N, tcp://HOST:PORT."""
    if text == "local":
        return Spec()
    if text.startswith("local:"):
        n = text.removeprefix("local:")
        if not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"local:N needs N, the workers, an integer >= 1, got {text!r}")
        return Spec(workers=within_cpus(int(n), f"--cluster {text}"))
    if text.startswith("tcp://"):
        host, _, port = text.removeprefix("tcp://").rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return Spec(address=text)
    raise argparse.ArgumentTypeError(f"expected local, local:N or tcp://HOST:PORT, got {text!r}")


def on_devices(devices) -> Spec:
    """``--devices I,J``: a local cluster of one worker per listed GPU."""
    return Spec(workers=len(devices), gpus=tuple(devices))


def import_distributed():
    """Dask's ``distributed``, or an ImportError that says how to install it."""
    try:
        import distributed
    except ImportError:
        raise ImportError(MISSING) from None
    return distributed


def _visible_gpus(engine) -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them for a child (empty: the engine
    runs on the host)."""
    if engine.xp.__name__ != "cupy":
        return []
    count = engine.xp.cuda.runtime.getDeviceCount()
    listed = [s.strip() for s in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if s.strip()]
    return listed[:count] if listed else [str(i) for i in range(count)]


def gpu_names(spec: Spec, engine) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each local worker (empty: CPU workers)."""
    visible = _visible_gpus(engine)
    if spec.gpus is None:
        return visible[:spec.workers] if spec.workers else visible
    if not visible:
        return [str(g) for g in spec.gpus]  # the CPU engine ran anyway (select_engine said why): harmless
    for g in spec.gpus:
        if g >= len(visible):
            raise ValueError(f"--devices: GPU {g} is not there ({len(visible)} visible)")
    return [visible[g] for g in spec.gpus]
