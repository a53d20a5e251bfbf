"""``apa gemma3``: dumps of Gemma 3 270M's attention on a text (the library's ``gemma3``, extra
``gemma3``)."""

from __future__ import annotations

from . import common

HELP = "run Gemma 3 270M on a text and write dumps of chosen layers (extra: gemma3)"
DESCRIPTION = ("run Gemma 3 270M (PyTorch float32, on CUDA when available) over a text and write one dump per "
               "layer; 32768 tokens take about 8 CPU-minutes (4.5 min on 2 idle cores)")


def add_arguments(p) -> None:
    common.model_options(p, "all of Alice in Wonderland",
                         "layers to dump, 0..17 (default: the global layers 5 11 17; the others attend to a 512-key "
                         "window, which the dump does not record)", None, 32768,
                         "the model was trained to 32768; past it, a warning")


def run(args) -> None:
    common.model_dumps(args, "gemma3", "Gemma 3 layers", "loading the model, about 30 s")
