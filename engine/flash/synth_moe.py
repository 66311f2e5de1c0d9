"""MoE synthetic presets: random-weight but valid quantized Qwen3-MoE models, and their GGUF export.

What it knows: the `qwen3_moe` layout of mlx-lm (attention with q/k norms, a float router
`mlp.gate`, experts stacked as `mlp.switch_mlp.{gate,up,down}_proj`), writing it tensor by tensor
in expert-row chunks (never a whole expert tensor in RAM), a router-skew option, and the export of
the very same weights as a `qwen3moe` GGUF for llama-server (MLX affine 4-bit group 64 is Q4_1 with
each group's (scale, bias) repeated for its two 32-element halves: exact).

Router skew (`skew` > 0): every token embedding gets a shared component `c` (constant within each
quantization group, so it is exact in the 4-bit codes: it shifts the group biases), and each
layer's router rows get `skew * g_e * c / hidden` (a logit bias of about skew * g_e for a
token made of c alone, whatever the width) with a Zipf-like popularity `g_e` over a per-layer
permutation of the experts. Tokens then agree on the popular experts (popularity skew) while the
random part of the router still depends on the token (reuse between tokens comes from repeated
tokens and from the shared component). `skew = 0`: routing is close to uniform.

What it does not know: dense presets (synth.py), splitting (split.py).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .safetensors_io import TensorSpec
from .synth import VOCAB, record_source_gguf, write_model_dir
from .synth import gguf_name as dense_gguf_name

GROUP, BITS = 64, 4


@dataclass(frozen=True)
class MoEPreset:
    hidden: int
    layers: int
    experts: int
    top_k: int
    moe_inter: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float = 1000000.0
    context: int = 8192


MOE_PRESETS: dict[str, MoEPreset] = {
    "qwen3-30b-a3b": MoEPreset(2048, 48, 128, 8, 768, 32, 4, 128),  # Qwen3-30B-A3B shapes: 16.3 GB of experts
    "moe-tiny": MoEPreset(256, 3, 16, 4, 128, 4, 2, 64),  # tests: ~3 MB
    "moe-heavy": MoEPreset(512, 12, 128, 4, 768, 8, 2, 64),  # tests (cgroup): ~1 GB, experts ~97% of it
}


def config_for(p: MoEPreset, skew: float = 0.0) -> dict[str, Any]:
    q = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
    return {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": p.hidden,
        "num_hidden_layers": p.layers,
        "intermediate_size": p.moe_inter * 8,
        "moe_intermediate_size": p.moe_inter,
        "num_experts": p.experts,
        "num_experts_per_tok": p.top_k,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "rope_theta": p.rope_theta,
        "max_position_embeddings": p.context,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "quantization": q,
        "quantization_config": q,
        "flashcode_router_skew": skew,
    }


def quantized(p: MoEPreset) -> list[tuple[str, int, int, int]]:
    """(module, experts (0 = plain linear), out, in) for every quantized linear."""
    out = [("model.embed_tokens", 0, VOCAB, p.hidden), ("lm_head", 0, VOCAB, p.hidden)]
    q, kv = p.heads * p.head_dim, p.kv_heads * p.head_dim
    for i in range(p.layers):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp.switch_mlp"
        out += [
            (f"{a}.q_proj", 0, q, p.hidden),
            (f"{a}.k_proj", 0, kv, p.hidden),
            (f"{a}.v_proj", 0, kv, p.hidden),
            (f"{a}.o_proj", 0, p.hidden, q),
            (f"{m}.gate_proj", p.experts, p.moe_inter, p.hidden),
            (f"{m}.up_proj", p.experts, p.moe_inter, p.hidden),
            (f"{m}.down_proj", p.experts, p.hidden, p.moe_inter),
        ]
    return out


def floats(p: MoEPreset) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [("model.norm.weight", (p.hidden,))]
    for i in range(p.layers):
        pre = f"model.layers.{i}"
        out += [
            (f"{pre}.input_layernorm.weight", (p.hidden,)),
            (f"{pre}.post_attention_layernorm.weight", (p.hidden,)),
            (f"{pre}.self_attn.q_norm.weight", (p.head_dim,)),
            (f"{pre}.self_attn.k_norm.weight", (p.head_dim,)),
            (f"{pre}.mlp.gate.weight", (p.experts, p.hidden)),
        ]
    return out


def tensor_specs(p: MoEPreset) -> list[TensorSpec]:
    specs = []
    for name, e, o, i in quantized(p):
        lead = (e,) if e else ()
        specs += [
            TensorSpec(f"{name}.weight", "U32", (*lead, o, i * BITS // 32)),
            TensorSpec(f"{name}.scales", "F16", (*lead, o, i // GROUP)),
            TensorSpec(f"{name}.biases", "F16", (*lead, o, i // GROUP)),
        ]
    specs += [TensorSpec(n, "F32", s) for n, s in floats(p)]
    return sorted(specs, key=lambda s: s.name)


def shared_direction(p: MoEPreset, seed: int) -> np.ndarray:
    """The shared embedding component's sign per quantization group (constant inside a group)."""
    rng = np.random.default_rng([seed, 7])
    return np.repeat(rng.choice([-1.0, 1.0], size=p.hidden // GROUP), GROUP)


def _rows(
    name: str, e: int, o: int, i: int, seed: int, skew: float, p: MoEPreset
) -> Iterator[tuple[np.ndarray, ...]]:
    """(packed, scales, biases) in chunks of rows (whole experts for stacked tensors)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    gain = 1.0 if name == "model.embed_tokens" else 1.0 / np.sqrt(i)
    total = (e or 1) * o
    step = max(o, (8 << 20) // (i // 2) // o * o) if e else max(1, (8 << 20) // (i // 2))
    shift = 0.0
    if name == "model.embed_tokens" and skew:
        shift = shared_direction(p, seed)[::GROUP][None, :]  # one value per group: exact in the codes
    for r0 in range(0, total, step):
        n = min(step, total - r0)
        packed = rng.integers(0, 1 << 32, size=(n, i * BITS // 32), dtype=np.uint32)
        s = (gain / 4.61) * rng.uniform(0.8, 1.2, size=(n, i // GROUP))
        b = -7.5 * s + shift
        shape = (n // o, o) if e else (n,)
        yield (
            packed.reshape(*shape, -1),
            s.astype(np.float16).reshape(*shape, -1),
            b.astype(np.float16).reshape(*shape, -1),
        )


def router(p: MoEPreset, layer: int, seed: int, skew: float) -> np.ndarray:
    rng = np.random.default_rng([seed, 1000 + layer])
    w = rng.standard_normal((p.experts, p.hidden)) / np.sqrt(p.hidden)
    if skew:
        popularity = 1.0 / np.arange(1, p.experts + 1) ** 0.5  # Zipf-like, over a per-layer permutation
        g = popularity[rng.permutation(p.experts)]
        c = shared_direction(p, seed)
        w += skew * g[:, None] * (c / p.hidden)[None, :]  # logit bias ~ skew * g_e * (share of c in x)
    return w.astype(np.float32)


def _tensor_stream(p: MoEPreset, seed: int, skew: float) -> Iterator[tuple[str, Iterator[np.ndarray]]]:
    mods = {name: (e, o, i) for name, e, o, i in quantized(p)}
    leafs = {"weight": 0, "scales": 1, "biases": 2}
    for spec in tensor_specs(p):
        mod, _, leaf = spec.name.rpartition(".")
        if mod in mods:
            e, o, i = mods[mod]
            yield spec.name, (c[leafs[leaf]] for c in _rows(mod, e, o, i, seed, skew, p))
        elif mod.endswith(".mlp.gate"):
            yield spec.name, iter([router(p, int(mod.split(".")[2]), seed, skew)])
        else:
            yield spec.name, iter([np.ones(spec.shape, dtype=np.float32)])


def preset_for(name: str, layers: int | None = None) -> MoEPreset:
    if name not in MOE_PRESETS:
        raise ValueError(f"unknown MoE preset {name!r}; choose one of: {', '.join(MOE_PRESETS)}")
    return MOE_PRESETS[name] if layers is None else replace(MOE_PRESETS[name], layers=layers)


def synth_moe(
    preset: str,
    out: Path,
    layers: int | None = None,
    seed: int = 0,
    skew: float = 0.0,
    progress: bool = True,
    tokenizer_dir: Path | None = None,
) -> Path:
    """Write the MoE preset as an mlx-lm model directory at `out`; returns `out`."""
    p = preset_for(preset, layers)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_model_dir(
        out, tensor_specs(p), _tensor_stream(p, seed, skew), f"synth {preset}", progress, tokenizer_dir
    )
    (out / "config.json").write_text(json.dumps(config_for(p, skew), indent=2))
    (out / "flashcode.json").write_text(
        json.dumps(
            {
                "architecture": "qwen3_moe",
                "synthetic": preset,
                "layers": p.layers,
                "seed": seed,
                "router_skew": skew,
            }
        )
    )
    return out


# --------------------------------------------------------------------------- GGUF export (qwen3moe)
_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}


def gguf_name(mod: str) -> str:
    return dense_gguf_name(mod, _GGUF)


def _order(mod: str) -> tuple[int, str]:
    parts = mod.split(".")
    return (
        int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1 if "embed" in mod else 1 << 30,
        mod,
    )


def export_gguf_moe(
    model_dir: Path, out: Path, tokenizer_gguf: Path | None = None, progress: bool = True
) -> Path:
    """The MoE model's weights, the same values, as a qwen3moe GGUF (Q4_1 experts/attention, F32 norms/router)."""
    import gguf
    from safetensors import safe_open
    from tqdm import tqdm

    from .synth import _gguf_metadata, _q4_1_blocks

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    q = cfg.get("quantization") or {}
    if q.get("bits") != 4 or q.get("group_size") not in (32, 64):
        raise ValueError("GGUF export needs a uniformly 4-bit model with group 32 or 64 (Q4_1)")
    rep = q["group_size"] // 32
    w = gguf.GGUFWriter(str(out), "qwen3moe")
    _gguf_metadata(w, {**cfg, "intermediate_size": cfg["moe_intermediate_size"]}, tokenizer_gguf)
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    f = safe_open(str(model_dir / "model.safetensors"), "np")
    keys = set(f.keys())
    mods = sorted({k.rpartition(".")[0] for k in keys}, key=_order)
    for mod in mods:
        shape = f.get_slice(f"{mod}.weight").get_shape()
        if f"{mod}.scales" in keys:
            *lead, o, words = shape
            nb = words * 8 // 32 * 20
            w.add_tensor_info(
                f"{gguf_name(mod)}.weight",
                (*lead, o, nb),
                np.dtype(np.uint8),
                int(np.prod(lead or [1])) * o * nb,
                gguf.GGMLQuantizationType.Q4_1,
            )
        else:
            w.add_tensor_info(
                f"{gguf_name(mod)}.weight", tuple(shape), np.dtype(np.float32), 4 * int(np.prod(shape))
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for mod in tqdm(mods, desc="export gguf", disable=not progress):
        if f"{mod}.scales" in keys:
            wt, sc, bi = (f.get_slice(f"{mod}.{leaf}") for leaf in ("weight", "scales", "biases"))
            shape = wt.get_shape()
            n = shape[0] if len(shape) == 3 else 1
            parts = []
            for e in range(n):  # one expert at a time: never a whole stacked tensor in RAM
                sl = (slice(e, e + 1),) if len(shape) == 3 else (slice(None),)
                pk, s, b = (t[sl].reshape(-1, t.get_shape()[-1]) for t in (wt, sc, bi))
                parts.append(
                    np.ascontiguousarray(_q4_1_blocks(pk, np.repeat(s, rep, 1), np.repeat(b, rep, 1)))
                )
                if len(parts) * parts[0].nbytes >= 64 << 20 or e == n - 1:
                    _write_part(w, parts, first=e + 1 == len(parts), last=e == n - 1)
                    parts = []
        else:
            w.write_tensor_data(f.get_tensor(f"{mod}.weight").astype(np.float32))
    w.close()
    record_source_gguf(model_dir, Path(out))
    return Path(out)


def _write_part(w: Any, parts: list[np.ndarray], first: bool, last: bool) -> None:
    """GGUFWriter.write_tensor_data for one tensor written in pieces (its tensor info popped on the first)."""
    fout = w.fout[0]
    if first:
        ti = w.tensors[0].pop(next(iter(w.tensors[0])))
        w._part_left = ti.nbytes
        w.write_padding(fout, fout.tell())
    for a in parts:
        a.tofile(fout)
        w._part_left -= a.nbytes
    if last:
        assert w._part_left == 0, "GGUF tensor written with the wrong size"
        w.write_padding(fout, fout.tell())
        from gguf.gguf_writer import WriterState

        w.state = WriterState.WEIGHTS
