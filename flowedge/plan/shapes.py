"""Model shapes for planning and simulation without weights: small JSON configs shipped in the package.

A shape is the subset of a Hugging Face config.json the cost and memory models read (hidden size, layer
count, heads, MLP width, vocabulary). `flowedge/model_shapes/*.json` covers the real pair and the
papers' models (LLaMA-2 7B/13B/70B), so a cluster for a 70B model can be planned and simulated on a
laptop; a directory with a config.json works too (the daemon plans from its own model's config).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flowedge.errors import ConfigError

SHAPES_DIR = Path(__file__).resolve().parents[1] / "model_shapes"
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "num_hidden_layers", "vocab_size")


def list_shapes() -> list[str]:
    return sorted(p.stem for p in SHAPES_DIR.glob("*.json"))


def load_shape(name_or_dir: str | Path) -> Any:
    """A config-like object (attributes as in a HF config) for a shipped shape name or a model directory."""
    path = Path(name_or_dir).expanduser()
    if path.is_dir():
        path = path / "config.json"
    elif str(name_or_dir) in list_shapes():
        path = SHAPES_DIR / f"{name_or_dir}.json"
    if not path.is_file():
        raise ConfigError(f"unknown model shape {str(name_or_dir)!r}: not one of {', '.join(list_shapes())} "
                          "nor a directory with a config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the model shape ({exc})") from None
    return shape_from_dict(data, str(name_or_dir))


def shape_from_dict(data: dict[str, Any], name: str) -> Any:
    missing = [k for k in REQUIRED if not isinstance(data.get(k), int) or data[k] <= 0]
    if missing:
        raise ConfigError(f"model shape {name!r} lacks positive integers for {missing}")
    values = {"name": name, "max_position_embeddings": 4096, "tie_word_embeddings": False, "head_dim": None, **data}
    return SimpleNamespace(**values)
