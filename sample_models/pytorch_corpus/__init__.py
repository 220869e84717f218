"""MoE layers re-implemented from public PyTorch code, for ``export_pytorch_corpus.py`` (torch).

``LAYERS`` lists every corpus layer (``common.Layer``) by name; each module's classes name the
upstream file they follow. ``docs/pytorch-corpus.md`` has the table.
"""

from __future__ import annotations

from . import hf_routers, hf_style, inference, training, tutorials
from .common import Layer

LAYERS: dict[str, Layer] = {
    layer.name: layer
    for mod in (inference, hf_style, hf_routers, training, tutorials)
    for layer in mod.LAYERS
}

__all__ = ["LAYERS", "Layer"]
