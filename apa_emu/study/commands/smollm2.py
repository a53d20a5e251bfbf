"""``apa smollm2``: dumps of SmolLM2-135M's attention on a text (the library's ``smollm2``, extra
``models``)."""

from __future__ import annotations

from . import common

HELP = "run SmolLM2-135M on a text and write dumps of chosen layers (extra: models)"
DESCRIPTION = ("run SmolLM2-135M-Instruct (float32 NumPy on the CPU) over a text and write one dump per layer; "
               "8192 tokens take about 3 CPU-minutes")


def add_arguments(p) -> None:
    common.model_options(p, "Alice in Wonderland I–IV", "layers to dump (0..29)", [14], 2048,
                         "at most 8192, the model's context")


def run(args) -> None:
    common.model_dumps(args, "smollm2", "SmolLM2 layers", "loading the model, about 5 s")
