"""Compare two converted checkpoints tensor by tensor (e.g. one converted by an older flowedge).

    python tools/compare_checkpoints.py DIR_A DIR_B

Checks: the same tensor names in the same order, dtypes, shapes and bitwise-equal values (one tensor
in memory at a time), the sha256 of both model.safetensors, config.json as transformers reads it, the
GGUF-held tensors flowedge.json records, and generation_config.json's token ids. Exit status 1 on any
difference.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from flowedge.models.safetensors_io import file_sha256

_VOLATILE = {"transformers_version", "_name_or_path", "_model_name_or_path"}


def tensors_differ(a: Path, b: Path) -> list[str]:
    out = []
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(b / "model.safetensors"), "pt") as fb:
        names_a, names_b = list(fa.keys()), list(fb.keys())
        if names_a != names_b:
            out.append(f"names differ: {sorted(set(names_a) ^ set(names_b))[:5]} (or their order)")
        for name in (n for n in names_a if n in set(names_b)):
            x, y = fa.get_tensor(name), fb.get_tensor(name)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                out.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        print(f"{len(names_a)} tensors compared")
    return out


def configs_differ(a: Path, b: Path) -> list[str]:
    from transformers import AutoConfig

    ca, cb = (AutoConfig.from_pretrained(p).to_dict() for p in (a, b))
    keys = (set(ca) | set(cb)) - _VOLATILE
    return [f"config {k}: {ca.get(k)!r} vs {cb.get(k)!r}" for k in sorted(keys) if ca.get(k) != cb.get(k)]


def markers_differ(a: Path, b: Path) -> list[str]:
    ma, mb = (json.loads((p / "flowedge.json").read_text()) for p in (a, b))
    out = [f"flowedge.json {k}: {ma.get(k)!r} vs {mb.get(k)!r}" for k in sorted(set(ma) | set(mb))
           if k != "gguf_tensors" and ma.get(k) != mb.get(k)]
    ga, gb = ma.get("gguf_tensors", {}), mb.get("gguf_tensors", {})
    for key in ("sha256", "path", "bytes", "tensors"):
        if ga.get(key) != gb.get(key):
            out.append(f"flowedge.json gguf_tensors.{key}: {ga.get(key)!r} vs {gb.get(key)!r}")
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    gen = [json.loads((p / "generation_config.json").read_text()) for p in (a, b)]
    out += [f"generation_config {k}" for k in ids if gen[0].get(k) != gen[1].get(k)]
    return out


def main(a: Path, b: Path) -> int:
    diffs = tensors_differ(a, b) + configs_differ(a, b) + markers_differ(a, b)
    same_file = file_sha256(a / "model.safetensors") == file_sha256(b / "model.safetensors")
    print(f"model.safetensors byte-identical: {same_file}")
    for line in diffs:
        print("DIFF", line)
    print("same" if not diffs else f"{len(diffs)} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
