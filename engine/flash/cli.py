"""`flashcode split` and `flashcode synth`: registered into the main CLI by webapp/cli.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _layers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of layers: use a whole number of 1 or more"
        )
    return value


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "split",
        help="make a model streamable by the flash backend (in place: a manifest into its own shards)",
    )
    p.add_argument("model", help="model name (see `flashcode models`) or an mlx-lm model directory")
    p.add_argument("--out", default=None, help="where to write the split (default MODEL_DIR/split)")
    p.add_argument(
        "--copy", action="store_true", help="copy the weights into units.bin + a pinned file (twice on disk)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="split again even where the weights no longer match the last split's checksums (changed on purpose)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="flashcode's data directory (default $FLASHCODE_HOME or ~/.local/share/flashcode)",
    )
    p.set_defaults(func=cmd_split)

    from .synth import PRESETS
    from .synth_moe import MOE_PRESETS

    p = subparsers.add_parser("synth", help="write a random-weight quantized model of a real architecture")
    p.add_argument(
        "preset",
        choices=[*PRESETS, *MOE_PRESETS],
        metavar="PRESET",
        help=f"{', '.join(PRESETS)}; MoE: {', '.join(MOE_PRESETS)}",
    )
    p.add_argument(
        "--layers", type=_layers, default=None, help="fewer (or more) transformer layers than the preset"
    )
    p.add_argument(
        "--out", default=None, help="output directory (default $FLASHCODE_HOME/models/synth-PRESET[-LN])"
    )
    p.add_argument(
        "--gguf", action="store_true", help="also export the same weights as a Q4_1 GGUF for llama-server"
    )
    p.add_argument("--split", action="store_true", help="also write the flash split layout")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="MoE presets: router popularity skew (0 = near-uniform routing)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="flashcode's data directory (default $FLASHCODE_HOME or ~/.local/share/flashcode)",
    )
    p.set_defaults(func=cmd_synth)


def cmd_split(args: argparse.Namespace) -> int:
    from engine import paths
    from engine.models import find_model

    from .split import split_model

    if not args.model.strip():  # "" would name the models folder's default: say which one instead
        raise SystemExit("flashcode split: name the model to split (see `flashcode models`)")
    info = find_model(args.model, paths.home(args.data_dir), exact=True)  # it rewrites the model's files
    out = split_model(info.path, Path(args.out) if args.out else None, copy=args.copy, force=args.force)
    print(f"split written to {out}")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from engine import paths

    from .split import split_model
    from .synth import export_gguf, synth_model

    name = f"synth-{args.preset}" + (f"-l{args.layers}" if args.layers else "")
    out = Path(args.out) if args.out else paths.models_dir(paths.home(args.data_dir)) / name
    from .synth_moe import MOE_PRESETS, export_gguf_moe, synth_moe

    moe = args.preset in MOE_PRESETS
    if moe:
        synth_moe(args.preset, out, layers=args.layers, seed=args.seed, skew=args.skew)
    else:
        synth_model(args.preset, out, layers=args.layers, seed=args.seed)
    if args.gguf:
        (export_gguf_moe if moe else export_gguf)(out, out / "model.gguf")
    if args.split:
        split_model(out)
    print(f"synthetic model written to {out}")
    return 0
