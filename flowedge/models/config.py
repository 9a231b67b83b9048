"""The decoder's shape and constants, read from a checkpoint's config.json without transformers.

One frozen dataclass for the two families the registry ships (Qwen2 and Llama). Field names are the
Hugging Face ones, so profiles, the planner and the stage inbox read a `ModelConfig` exactly as they
read a transformers config; stage processes never import transformers.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowedge.errors import ModelError

FAMILIES = ("qwen2", "llama")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False        # q/k/v biases (always on in Qwen2)
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name: str = field(default="the model", compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise ModelError(f"model type {self.model_type!r} is not supported; flowedge runs {', '.join(FAMILIES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelError(f"{self.num_attention_heads} attention heads do not group over "
                             f"{self.num_key_value_heads} key/value heads")

    @property
    def group(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, name: str = "the model") -> "ModelConfig":
        model_type = raw.get("model_type", "")
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            theta = None
            for rope in (raw.get("rope_parameters"), raw.get("rope_scaling")):
                if not isinstance(rope, dict):
                    continue
                kind = rope.get("rope_type", rope.get("type", "default"))
                if kind not in ("default", None):
                    raise ModelError(f"{name}: rope scaling {kind!r} is not supported (only plain RoPE)")
                theta = theta or rope.get("rope_theta")
            return cls(
                model_type=model_type, hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]), num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                vocab_size=int(raw["vocab_size"]), head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta or raw.get("rope_theta", 10000.0)),
                attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"), name=name)
        except KeyError as e:
            raise ModelError(f"{name}: config.json lacks {e.args[0]!r}") from e
        except (TypeError, ValueError) as e:
            raise ModelError(f"{name}: config.json has a bad value ({e})") from e

    @classmethod
    def load(cls, model_dir: Path | str) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelError(f"{model_dir} has no config.json (not a model or shard directory)")
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelError(f"cannot read {path}: {e}") from e
        return cls.from_dict(raw, name=Path(model_dir).name)
