"""A study's units on a Dask cluster (``--cluster``): many dumps, many GPUs, many hosts.

``--cluster local[:N]`` starts a cluster on this machine: one worker per GPU when the engine runs on
GPUs (``dask_cuda.LocalCUDACluster`` when it is installed, else a Nanny per GPU with its
``CUDA_VISIBLE_DEVICES``), N workers otherwise (default: one per CPU). ``--cluster tcp://HOST:PORT``
uses a running scheduler. ``--devices I,J`` is ``--cluster local`` with one worker on each listed GPU.

A command asks ``cluster(spec, engine)`` for a ``Runner`` and hands it to its study as ``where``; the
study passes it on to ``engine.run_units``, which sends the units there instead of running them in
this process. Three modules, one concern each:

- ``options``: what --cluster and --devices name (``Spec``), the GPUs of a local cluster's workers,
  and Dask's import (the ``cluster`` extra, imported only when a cluster is asked for);
- ``scheduling``: the scheduler in front of Dask's, which cuts the units into tasks, runs some in this
  process, retries the ones that raise and puts the runs back in the units' order;
- ``startup``: the client on a running scheduler, or a local cluster started and warmed in a thread
  with Ctrl-C held off while its workers spawn, and closed off the main thread.
"""

from .options import Spec, on_devices, parse, within_cpus
from .scheduling import Runner
from .startup import closed, cluster, local

__all__ = ["Runner", "Spec", "closed", "cluster", "local", "on_devices", "parse", "within_cpus"]
