"""Fit a CPU profile path to measured stage steps, last-stage steps and draft calls (least squares).

    python tools/bench_steps.py --what draft,stage,last --rows 1,2,4,8,16,32 --rounds 7 > steps.json
    python tools/fit_cpu_profile.py steps.json [more.json ...] [--device x86-cpu] [--path cpu-native]
        [--before cpu-fp32] [--fit]

Without `--fit` it prints the profile's own predictions for every measured call (how well the shipped
path fits); with `--fit` it first fits the path's `eta_bw`, `eta_flops_small` (= `eta_flops_large`),
`overhead_fwd_s`, `overhead_layer_s` and `unpack_s_per_gb` to minimise the squared log error over all calls
and row counts (the box's drift is multiplicative). `bytes_per_param` is the profile's own (the TOML),
not fitted: the loaded models' bytes per parameter (`weight_bytes` in the JSON) are printed, and a
warning says when the TOML's value is more than 1% away from them (re-count it after a model or quant
change). The lm_head runs on the path's `head_path`. Several JSON files (runs at different minutes) are
averaged per call first. `--before` adds a column with another path's predictions (the old fp32 one).
Shapes: the first 14 layers of the 1.5B (stage), its last 14 + lm_head (last), the whole 0.5B (draft).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from scipy.optimize import least_squares

from flowedge.costs.model import (draft_time_s, forward_time_s, lm_head_time_s, shape_of_head,
                                  shape_of_layers)
from flowedge.costs.profiles import DeviceProfile, load_device
from flowedge.models.resolve import resolve_model
from flowedge.models.stage import load_config

BASE, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
LABELS = {"stage": "stage_step", "last": "last_step", "draft": "draft_call"}


def _measured(files: list[Path]) -> tuple[dict[tuple[str, int], float], dict]:
    """(call, rows) -> ms, the mean over the files' medians; and the weight bytes of the 14-layer runs.

    A call is `draft`, `last` or `stage 0-14` (the stage's layers, `stage_layers` in the JSON)."""
    out: dict[tuple[str, int], list[float]] = {}
    weight_bytes: dict = {}
    for f in files:
        run = json.loads(f.read_text())
        start, end = run.get("stage_layers", (0, 14))
        if (start, end) == (0, 14):
            for what, counted in run.get("weight_bytes", {}).items():
                weight_bytes.setdefault(what, counted)
        for what, label in LABELS.items():
            call = f"stage {start}-{end}" if what == "stage" else what
            for key, value in run.items():
                parts = key.split("_")
                if key.startswith(label + "_") and key.endswith("_ms") and parts[-2].isdigit():
                    out.setdefault((call, int(parts[-2])), []).append(float(value))
    return {k: statistics.mean(v) for k, v in sorted(out.items())}, weight_bytes


def predict(dev: DeviceProfile, path: str, call: str, rows: int, context: int, base, draft) -> float:
    """Milliseconds the profile charges for one measured call."""
    if call.startswith("stage"):
        start, end = (int(v) for v in call.split()[1].split("-"))
        return 1e3 * forward_time_s(dev, shape_of_layers(base, start, end), rows, context, path)
    if call == "last":
        return 1e3 * (forward_time_s(dev, shape_of_layers(base, 14, 28), rows, context, path)
                      + lm_head_time_s(dev, base, rows, path))
    return 1e3 * draft_time_s(dev, draft, rows, context, path, head_quantized=True)


def weight_mix(weight_bytes: dict, base, draft) -> dict[str, float]:
    """Bytes per parameter of the loaded models (the cost model's parameter counts)."""
    layers = weight_bytes["stage"]["layers"] + weight_bytes["last"]["layers"]
    return {
        "base_layers": layers / shape_of_layers(base, 0, 28).params,
        "stage_layers": weight_bytes["stage"]["layers"] / shape_of_layers(base, 0, 14).params,
        "last_layers": weight_bytes["last"]["layers"] / shape_of_layers(base, 14, 28).params,
        "base_head": weight_bytes["last"]["lm_head"] / shape_of_head(base).params,
        "draft_layers": weight_bytes["draft"]["layers"] / shape_of_layers(draft, 0, draft.num_hidden_layers).params,
        "draft_head": weight_bytes["draft"]["lm_head"] / shape_of_head(draft).params,
    }


def _with(dev: DeviceProfile, path: str, x) -> DeviceProfile:
    eta_bw, eta_f, o_fwd, o_layer, unpack = x
    shared = dict(eta_bw=eta_bw, eta_flops_small=eta_f, eta_flops_large=eta_f, unpack_s_per_gb=unpack)
    p = replace(dev.paths[path], overhead_fwd_s=o_fwd, overhead_layer_s=o_layer, **shared)
    paths = dict(dev.paths, **{path: p})
    head = p.head_path
    if head and head != path:   # the lm_head's own path shares the fitted efficiencies, not the bytes
        paths[head] = replace(dev.paths[head], **shared)
    return replace(dev, paths=paths)


def fit(dev: DeviceProfile, path: str, measured: dict, context: int, base, draft) -> DeviceProfile:
    """Least squares over log(predicted / measured): the VM's drift scales a run, it does not shift it."""
    def residuals(x):
        d = _with(dev, path, x)
        return [math.log(predict(d, path, w, r, context, base, draft) / ms) for (w, r), ms in measured.items()]
    p = dev.paths[path]
    x0 = [p.eta_bw, p.eta_flops_small, p.overhead_fwd_s, p.overhead_layer_s, p.unpack_s_per_gb]
    result = least_squares(residuals, x0, bounds=([0.05, 0.01, 0.0, 0.0, 0.0], [1.0, 1.0, 0.05, 0.005, 1.0]))
    return _with(dev, path, result.x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--device", default="x86-cpu")
    ap.add_argument("--path", default="cpu-native")
    ap.add_argument("--before", default="", help="another path of the device, predicted alongside")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--holdout", default="", help="a call (e.g. 'stage 0-7') left out of the fit, still shown")
    args = ap.parse_args()
    base, draft = load_config(resolve_model(BASE)), load_config(resolve_model(DRAFT))
    measured, weight_bytes = _measured(args.files)
    dev = load_device(args.device)
    if weight_bytes:
        mix = weight_mix(weight_bytes, base, draft)
        print("bytes per parameter:", json.dumps({k: round(v, 4) for k, v in mix.items()}))
        shipped = dev.paths[args.path].bytes_per_param
        if abs(shipped / mix["base_layers"] - 1) > 0.01:
            print(f"WARNING: {args.path}.bytes_per_param is {shipped} but the loaded base layers hold "
                  f"{mix['base_layers']:.4f} bytes a parameter: set it before fitting")
    if args.fit:
        used = {k: v for k, v in measured.items() if k[0] != args.holdout}
        dev = fit(dev, args.path, used, args.context, base, draft)
        p = dev.paths[args.path]
        print(f"fitted {args.path}: eta_bw {p.eta_bw:.4f} eta_flops {p.eta_flops_small:.4f} "
              f"overhead_fwd_s {p.overhead_fwd_s * 1e3:.3f} ms overhead_layer_s {p.overhead_layer_s * 1e6:.1f} us "
              f"unpack_s_per_gb {p.unpack_s_per_gb * 1e3:.2f} ms")
    before = f" | {args.before} ms" if args.before else ""
    print(f"| call | rows | measured ms | {args.path} ms | error{before} |")
    print("|---|---:|---:|---:|---:|" + ("---:|" if before else ""))
    errors = []
    for (call, rows), ms in measured.items():
        pred = predict(dev, args.path, call, rows, args.context, base, draft)
        errors.append(pred / ms - 1)
        old = f" | {predict(dev, args.before, call, rows, args.context, base, draft):.1f}" if args.before else ""
        held = " (held out)" if call == args.holdout else ""
        print(f"| {call}{held} | {rows} | {ms:.1f} | {pred:.1f} | {100 * (pred / ms - 1):+.1f}%{old} |")
    print(f"rms error {100 * math.sqrt(statistics.mean(e * e for e in errors)):.1f}%, "
          f"worst {100 * max(errors, key=abs):+.1f}%")


if __name__ == "__main__":
    main()
