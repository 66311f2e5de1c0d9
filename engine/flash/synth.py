"""`flashcode synth`: random-weight but valid quantized models of real shapes, for tests and benches.

What it knows: dense llama-family presets (shapes from the real models), writing an mlx-lm model
directory tensor by tensor in row chunks (never a whole large tensor in RAM), and exporting the
very same quantized weights to GGUF (MLX affine 4-bit, group 32, is exactly llama.cpp's Q4_1:
value = d*q + m) so llama-server runs them too.

What it does not know: MoE presets (the expert sniper issue adds them).

Vocabulary: the bundled default model's tokenizer (49152 tokens) is copied in, so every preset
uses that vocabulary rather than the original model's; all other shapes are the real ones.
Weights: uniform 4-bit codes with per-group scales chosen so each linear has ~1/sqrt(fan_in)
gain; outputs are gibberish but deterministic (seeded) and numerically tame.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .safetensors_io import TensorSpec, write_header

GROUP, BITS = 32, 4
VOCAB = 49152


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    tie: bool = False
    context: int = 8192


PRESETS: dict[str, Preset] = {
    "llama-8b": Preset(4096, 32, 14336, 32, 8, 128),  # Llama-3.1-8B shapes, 4-bit: ~4.5 GB
    "llama-3b": Preset(3072, 28, 8192, 24, 8, 128),  # Llama-3.2-3B shapes
    "llama-1b": Preset(2048, 16, 8192, 32, 8, 64, tie=True),  # Llama-3.2-1B shapes
    "tiny": Preset(256, 4, 1024, 4, 2, 64, tie=True),  # tests: ~10 MB
    "ffn-heavy": Preset(512, 88, 8192, 8, 2, 64, tie=True),  # tests: ~0.75 GB, FFN ~95% of it
}


def config_for(p: Preset) -> dict[str, Any]:
    q = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    return {
        "model_type": "llama",
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "intermediate_size": p.intermediate,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "rope_theta": p.rope_theta,
        "max_position_embeddings": p.context,
        "tie_word_embeddings": p.tie,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_traditional": False,
        "quantization": q,
        "quantization_config": q,
    }


def linears(p: Preset) -> list[tuple[str, int, int]]:
    """(module name, out, in) for every quantized linear, in file order."""
    out: list[tuple[str, int, int]] = [("model.embed_tokens", VOCAB, p.hidden)]
    q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
    for i in range(p.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out += [
            (f"{a}.q_proj", q, p.hidden),
            (f"{a}.k_proj", kv, p.hidden),
            (f"{a}.v_proj", kv, p.hidden),
            (f"{a}.o_proj", p.hidden, q),
            (f"{m}.gate_proj", p.intermediate, p.hidden),
            (f"{m}.up_proj", p.intermediate, p.hidden),
            (f"{m}.down_proj", p.hidden, p.intermediate),
        ]
    if not p.tie:
        out.append(("lm_head", VOCAB, p.hidden))
    return out


def norms(p: Preset) -> list[str]:
    names = [
        f"model.layers.{i}.{n}"
        for i in range(p.layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    return names + ["model.norm"]


def tensor_specs(p: Preset) -> list[TensorSpec]:
    specs = []
    for name, o, i in linears(p):
        specs += [
            TensorSpec(f"{name}.weight", "U32", (o, i * BITS // 32)),
            TensorSpec(f"{name}.scales", "F16", (o, i // GROUP)),
            TensorSpec(f"{name}.biases", "F16", (o, i // GROUP)),
        ]
    specs += [TensorSpec(f"{n}.weight", "F32", (p.hidden,)) for n in norms(p)]
    return sorted(specs, key=lambda s: s.name)


def _rows(
    rng: np.random.Generator, o: int, i: int, gain: float, rows: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(packed uint32, scales f16, biases f16) for `rows` rows at a time: w = s*q + b, q uniform 0..15."""
    for r0 in range(0, o, rows):
        n = min(rows, o - r0)
        packed = rng.integers(0, 1 << 32, size=(n, i * BITS // 32), dtype=np.uint32)
        s = (gain / 4.61) * rng.uniform(0.8, 1.2, size=(n, i // GROUP))
        yield packed, s.astype(np.float16), (-7.5 * s).astype(np.float16)


def _gain(name: str, i: int) -> float:
    return 1.0 if name == "model.embed_tokens" else 1.0 / np.sqrt(i)


def _tensor_stream(p: Preset, seed: int) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    """Each tensor's name and its data in row chunks, generated deterministically per module."""
    mods = {name: (o, i) for name, o, i in linears(p)}

    def part(name: str, kind: int) -> Iterator[np.ndarray]:
        o, i = mods[name]
        rng = np.random.default_rng([seed, zlib_hash(name)])
        rows = max(1, (8 << 20) // (i // 2))
        for chunk in _rows(rng, o, i, _gain(name, i), rows):
            yield chunk[kind]

    for spec in tensor_specs(p):
        mod, _, leaf = spec.name.rpartition(".")
        if mod in mods:
            yield spec.name, part(mod, {"weight": 0, "scales": 1, "biases": 2}[leaf])
        else:
            yield spec.name, iter([np.ones(p.hidden, dtype=np.float32)])


def zlib_hash(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def default_tokenizer_dir() -> Path:
    from ..models import find_model

    return find_model(None).path


def write_model_dir(
    out: Path,
    specs: list[TensorSpec],
    stream: Iterator[tuple[Any, Iterable[np.ndarray]]],
    desc: str,
    progress: bool,
    tokenizer_dir: Path | None,
) -> None:
    """Write `model.safetensors` at `out` from `stream` (each tensor's chunks, in `specs`' order; written
    under a temporary name, renamed when complete) and copy the tokenizer files beside it."""
    from tqdm import tqdm

    bar = tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc=desc, disable=not progress)
    with open(out / "model.safetensors.tmp", "wb") as f:
        write_header(f, specs)
        for _, chunks in stream:
            for c in chunks:
                f.write(np.ascontiguousarray(c).tobytes())
                bar.update(c.nbytes)
    bar.close()
    (out / "model.safetensors.tmp").rename(out / "model.safetensors")
    tok = tokenizer_dir or default_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (tok / name).exists():
            shutil.copy2(tok / name, out / name)


def synth_model(
    preset: str,
    out: Path,
    layers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write the preset as an mlx-lm model directory at `out`; returns `out`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    p = PRESETS[preset] if layers is None else replace(PRESETS[preset], layers=layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_model_dir(out, tensor_specs(p), _tensor_stream(p, seed), f"synth {preset}", progress, tokenizer_dir)
    cfg = config_for(p)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "flashcode.json").write_text(
        json.dumps({"architecture": "llama", "synthetic": preset, "layers": p.layers, "seed": seed})
    )
    return out


# --------------------------------------------------------------------------- GGUF export
def _q4_1_blocks(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """MLX affine 4-bit (group 32) rows -> llama.cpp Q4_1 blocks: [d f16, m f16, 16 bytes of nibbles]."""
    rows, words = packed.shape
    nib = packed.view(np.uint8).reshape(rows, -1)  # little-endian: element 2k low nibble, 2k+1 high
    q = np.empty((rows, nib.shape[1] * 2), dtype=np.uint8)
    q[:, 0::2], q[:, 1::2] = nib & 0xF, nib >> 4
    q = q.reshape(rows, -1, 32)
    qs = q[:, :, :16] | (q[:, :, 16:] << 4)  # Q4_1: byte j holds elements j and j+16
    blocks = np.empty((rows, q.shape[1], 20), dtype=np.uint8)
    blocks[:, :, 0:2] = scales.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    blocks[:, :, 2:4] = biases.astype(np.float16).view(np.uint8).reshape(rows, -1, 2)
    blocks[:, :, 4:] = qs
    return blocks.reshape(rows, -1)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert-time permutation of Q/K rows (engine.gguf undoes it on import)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(mod: str, names: dict[str, str] = _GGUF_NAMES) -> str:
    """An mlx-lm module path -> llama.cpp's tensor name (without `.weight`); `names` maps a block's modules."""
    if mod == "model.embed_tokens":
        return "token_embd"
    if mod == "model.norm":
        return "output_norm"
    if mod == "lm_head":
        return "output"
    _, _, i, rest = mod.split(".", 3)
    return f"blk.{i}.{names[rest]}"


def export_gguf(
    model_dir: Path, out: Path, tokenizer_gguf: Path | None = None, progress: bool = True
) -> Path:
    """The model directory's quantized weights, byte-for-byte the same values, as a Q4_1 GGUF."""
    import gguf
    from safetensors import safe_open
    from tqdm import tqdm

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    q = cfg.get("quantization") or {}
    if q.get("bits") != 4 or q.get("group_size") != 32 or any(isinstance(v, dict) for v in q.values()):
        raise ValueError("GGUF export needs a uniformly 4-bit, group-32 model (Q4_1); this one is not")
    w = gguf.GGUFWriter(str(out), "llama")
    _gguf_metadata(w, cfg, tokenizer_gguf)
    f = safe_open(str(model_dir / "model.safetensors"), "np")
    mods = sorted({k.rpartition(".")[0] for k in f.keys()}, key=_gguf_order)
    for mod in mods:
        name = gguf_name(mod)
        if f"{mod}.scales" in f.keys():
            o, words = f.get_slice(f"{mod}.weight").get_shape()
            w.add_tensor_info(
                f"{name}.weight",
                (o, words * 8 // 32 * 20),
                np.dtype(np.uint8),
                o * words * 8 // 32 * 20,
                gguf.GGMLQuantizationType.Q4_1,
            )
        else:
            n = f.get_slice(f"{mod}.weight").get_shape()[0]
            w.add_tensor_info(f"{name}.weight", (n,), np.dtype(np.float32), 4 * n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for mod in tqdm(mods, desc="export gguf", disable=not progress):
        if f"{mod}.scales" in f.keys():
            data = _q4_1_blocks(
                f.get_tensor(f"{mod}.weight"), f.get_tensor(f"{mod}.scales"), f.get_tensor(f"{mod}.biases")
            )
            if mod.endswith(("q_proj", "k_proj")):
                heads = cfg["num_attention_heads"] if mod.endswith("q_proj") else cfg["num_key_value_heads"]
                data = _permute(data, heads)
            w.write_tensor_data(np.ascontiguousarray(data))
        else:
            w.write_tensor_data(f.get_tensor(f"{mod}.weight").astype(np.float32))
    w.close()
    record_source_gguf(model_dir, Path(out))
    return Path(out)


def record_source_gguf(model_dir: Path, gguf_path: Path) -> None:
    """flashcode.json names the GGUF of the same weights: `--backend llama` serves the model from it."""
    meta_path = Path(model_dir) / "flashcode.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    meta["source_gguf"] = str(gguf_path.resolve())
    meta_path.write_text(json.dumps(meta))


def _gguf_order(mod: str) -> tuple[int, str]:
    parts = mod.split(".")
    return (
        int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1 if "embed" in mod else 1 << 30,
        mod,
    )


def _gguf_metadata(w: Any, cfg: dict[str, Any], tokenizer_gguf: Path | None) -> None:
    import gguf

    w.add_name("flashcode synthetic")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg["rms_norm_eps"]))
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(3)  # MOSTLY_Q4_1
    w.add_quantization_version(2)
    src = tokenizer_gguf or _default_gguf()
    reader = gguf.GGUFReader(str(src))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)


def _default_gguf() -> Path:
    from .. import paths
    from ..models import DEFAULT_WHEEL_MEMBER

    p = paths.gguf_dir() / Path(DEFAULT_WHEEL_MEMBER).name
    if not p.exists():
        raise FileNotFoundError(
            f"the default model's GGUF (for its tokenizer) is missing at {p}: run `flashcode setup`"
        )
    return p
