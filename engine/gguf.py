"""GGUF -> MLX model directory (`flashcode import FILE.gguf`).

What it knows: llama.cpp's GGUF layout (metadata keys, tensor names, block quant types), how each
supported architecture maps to an mlx-lm `config.json` and to Hugging Face tensor names, and how to
rebuild a `tokenizer.json` from the GGUF vocabulary (through transformers' GGUF tokenizer builders).

What it does not know: running models. The output is an ordinary mlx-lm model directory.

Weights:
- Q4_0 / Q4_1 / Q8_0 come out of `mx.load` already as MLX affine-quantized triples (weight, scales,
  biases; group 32) and are kept bit for bit; the bits can differ per tensor (the embedding is
  often 8-bit), which goes into the config's per-module `quantization` entries.
- F32 / F16 / BF16 are carried over.
- K-quants and other block types are dequantized with the `gguf` package and requantized
  (4 or 8 bits, group 64).
- llama.cpp permutes the Q and K rows of llama-family models for its RoPE kernel; that is undone,
  so the weights are the Hugging Face ones and mlx-lm's usual RoPE applies.

Nothing half-written is left: the model is built in a temporary directory next to the target and
renamed into place at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .base import EngineError
from .flash.safetensors_io import TensorSpec

log = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
IMPORTER_VERSION = (
    2  # 2: sharded safetensors written chunk by chunk (an index; FFN tensors gate, up, down in a row)
)


class GGUFImportError(EngineError):
    pass


# ggml types converted exactly to MLX affine-quantized triples / carried over as plain arrays
_MLX_NATIVE_QUANT = {"Q4_0", "Q4_1", "Q8_0"}
_MLX_NATIVE_PLAIN = {"F32", "F16", "BF16"}
# ggml types the `gguf` package can dequantize, and the bits we requantize them to
_REQUANT_BITS = {
    "Q2_K": 4,
    "Q3_K": 4,
    "Q4_K": 4,
    "Q5_K": 8,
    "Q6_K": 8,
    "Q8_K": 8,
    "Q5_0": 8,
    "Q5_1": 8,
    "IQ4_NL": 4,
    "IQ4_XS": 4,
}
SUPPORTED_TENSOR_TYPES = sorted(_MLX_NATIVE_QUANT | _MLX_NATIVE_PLAIN | set(_REQUANT_BITS))


# --------------------------------------------------------------------------- architectures
@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    permute_qk: bool = False  # llama.cpp's convert permuted Q/K rows
    norm_offset: float = 0.0  # gemma stores (1 + w) in GGUF; mlx-lm adds the 1 itself
    build: Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Any]] | None = None
    extra_names: dict[str, str] = field(default_factory=dict)


def _common(md: dict[str, Any], arch: str, shapes: dict[str, Any]) -> dict[str, Any]:
    g = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
    hidden = int(g("embedding_length"))
    heads = int(g("attention.head_count"))
    kv = g("attention.head_count_kv", heads)
    kv = int(kv if np.ndim(kv) == 0 else max(kv))
    head_dim = int(g("attention.key_length", hidden // heads))
    vocab = int(shapes["token_embd"][0])
    ff = g("feed_forward_length", 0)
    cfg: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(g("block_count")),
        "intermediate_size": int(ff if np.ndim(ff) == 0 else max(ff)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(f"{float(g('attention.layer_norm_rms_epsilon', 1e-6)):.6g}"),
        "vocab_size": vocab,
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": "output" not in shapes,
    }
    for key in ("bos_token_id", "eos_token_id"):
        if f"tokenizer.ggml.{key}" in md:
            cfg[key] = int(md[f"tokenizer.ggml.{key}"])
    scaling = g("rope.scaling.type")
    factor = g("rope.scaling.factor")
    if scaling and scaling != "none" and factor:
        rs: dict[str, Any] = {"type": scaling, "rope_type": scaling, "factor": float(factor)}
        orig = g("rope.scaling.original_context_length")
        if orig:
            rs["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rs
    return cfg


def _llama(md: dict[str, Any], arch: str, shapes: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(md, arch, shapes)
    cfg.update(attention_bias="blk.0.attn_q.bias" in shapes, mlp_bias=False, rope_traditional=False)
    return cfg


def _qwen3_moe(md: dict[str, Any], arch: str, shapes: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(md, arch, shapes)
    cfg.update(
        num_experts=int(md[f"{arch}.expert_count"]),
        num_experts_per_tok=int(md[f"{arch}.expert_used_count"]),
        moe_intermediate_size=int(md[f"{arch}.expert_feed_forward_length"]),
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    )
    return cfg


def _gemma2(md: dict[str, Any], arch: str, shapes: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(md, arch, shapes)
    # llama.cpp scales queries by 1/sqrt(hidden/heads) for the 46-layer (27B) model, else 1/sqrt(head_dim)
    scalar = (
        cfg["hidden_size"] // cfg["num_attention_heads"]
        if cfg["num_hidden_layers"] == 46
        else cfg["head_dim"]
    )
    cfg.update(
        attn_logit_softcapping=float(md.get(f"{arch}.attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(md.get(f"{arch}.final_logit_softcapping", 30.0)),
        query_pre_attn_scalar=int(scalar),
        rope_traditional=False,
        tie_word_embeddings=True,
    )
    return cfg


def _gemma3(md: dict[str, Any], arch: str, shapes: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(md, arch, shapes)
    cfg.update(
        query_pre_attn_scalar=int(cfg["head_dim"]),
        sliding_window=int(md.get(f"{arch}.attention.sliding_window", 512)),
        sliding_window_pattern=6,
        rope_local_base_freq=10000.0,
        tie_word_embeddings=True,
    )
    if "rope_scaling" in cfg:
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": cfg["rope_scaling"]["factor"]}
    return cfg


def _phi3(md: dict[str, Any], arch: str, shapes: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(md, arch, shapes)
    rot = int(md.get(f"{arch}.rope.dimension_count", cfg["head_dim"]))
    cfg.update(partial_rotary_factor=rot / cfg["head_dim"], rope_traditional=False)
    orig = md.get(f"{arch}.rope.scaling.original_context_length")
    if orig:
        cfg["original_max_position_embeddings"] = int(orig)
    cfg.pop("rope_scaling", None)  # long-rope factors are filled in from tensors, see _phi3_rope
    return cfg


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", permute_qk=True, build=_llama),
    "mistral": ArchSpec("llama", permute_qk=True, build=_llama),
    "qwen2": ArchSpec("qwen2", build=_llama),
    "qwen3": ArchSpec("qwen3", build=_llama),
    "qwen3moe": ArchSpec("qwen3_moe", build=_qwen3_moe),
    "gemma2": ArchSpec("gemma2", norm_offset=1.0, build=_gemma2),
    "gemma3": ArchSpec("gemma3_text", norm_offset=1.0, build=_gemma3),
    "phi3": ArchSpec("phi3", build=_phi3),
}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
    "ffn_up_exps": "mlp.switch_mlp.up_proj",
    "ffn_down_exps": "mlp.switch_mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# gemma's four norms per layer: its ffn_norm is the *pre*-feed-forward one
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIP = re.compile(r"^(rope_freqs|rope_factors_long|rope_factors_short)(\.weight)?$")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (None: not a model weight)."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias", "scales", "biases"):
        base, suffix = gguf_name, ""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    table = (
        _GEMMA_LAYER_NAMES
        if arch.startswith("gemma")
        else _PHI3_LAYER_NAMES
        if arch == "phi3"
        else _LAYER_NAMES
    )
    if m:
        mapped = table.get(m.group(2))
        out = f"model.layers.{m.group(1)}.{mapped}" if mapped else None
    else:
        out = _TOP_NAMES.get(base)
    if out is None:
        return None
    return f"{out}.{suffix}" if suffix else out


# --------------------------------------------------------------------------- reading
@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf ReaderTensor

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def _check_header(path: Path) -> None:
    if not path.exists():
        raise GGUFImportError(f"{path}: no such file")
    if path.is_dir():
        raise GGUFImportError(f"{path} is a directory: give the path of a .gguf file")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'): "
            "pass a llama.cpp .gguf model file"
        )


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse header, metadata and tensor table; checks the file is whole."""
    from gguf import GGUFReader

    path = Path(path)
    _check_header(path)
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # the gguf package raises ValueError/struct.error/IndexError on damage
        raise GGUFImportError(
            f"{path} is damaged or truncated ({type(exc).__name__}: {exc}): download it again"
        ) from exc
    size = path.stat().st_size
    tensors = {}
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes < t.n_bytes:
            raise GGUFImportError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {size} bytes; download it again"
            )
        tensors[t.name] = t
    metadata: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            metadata[key] = fld.contents()
        except Exception:  # noqa: BLE001 - an odd field must not stop an import
            continue
    return GGUFFile(path, metadata, tensors)


def tensor_type_name(t: Any) -> str:
    return t.tensor_type.name


def check_supported(gf: GGUFFile) -> ArchSpec:
    arch = gf.architecture
    if arch not in ARCHITECTURES:
        raise GGUFImportError(
            f"{gf.path.name}: architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    for name, t in gf.tensors.items():
        tname = tensor_type_name(t)
        if tname not in SUPPORTED_TENSOR_TYPES:
            raise GGUFImportError(
                f"{gf.path.name}: tensor {name} has type {tname}, which flashcode cannot import; "
                f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}. Re-quantize it with llama-quantize "
                "to Q4_K_M, Q8_0 or Q4_0"
            )
    return ARCHITECTURES[arch]


# --------------------------------------------------------------------------- tokenizer
# llama.cpp pre-tokenizers that split every digit and then apply GPT-2's regex
_DIGIT_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def build_tokenizer(gf: GGUFFile, out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json rebuilt from the GGUF vocabulary."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm

    md = gf.metadata
    tdict: dict[str, Any] = {}
    for key, name in gtm.GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        if f"tokenizer.{key}" in md:
            tdict[name] = md[f"tokenizer.{key}"]
    if "tokens" not in tdict:
        raise GGUFImportError(f"{gf.path.name} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    arch = gf.architecture
    try:
        tok = gtm.select_tokenizer_builder(arch, tdict.get("tokenizer_type"))(tdict)
    except ValueError as exc:
        raise GGUFImportError(f"{gf.path.name}: {exc}") from exc
    tok = gtm.add_gguf_special_tokens(tok, tdict)
    tok = gtm.set_split_regex(tok, tdict)
    if tdict.get("pre_tokenizer_type") in _DIGIT_THEN_GPT2:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    tokens = tdict["tokens"]
    special = {}
    for attr, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unk_token_id"),
        ("pad_token", "pad_token_id"),
    ):
        idx = tdict.get(key)
        if idx is not None and 0 <= int(idx) < len(tokens):
            special[attr] = tokens[int(idx)]
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update(special)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    add_bos = md.get("tokenizer.ggml.add_bos_token", tdict.get("tokenizer_type") == "llama")
    cfg["add_bos_token"] = bool(add_bos)
    cfg["add_eos_token"] = bool(md.get("tokenizer.ggml.add_eos_token", False))
    cfg["model_max_length"] = int(md.get(f"{arch}.context_length", 4096))
    template = md.get("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
        (out_dir / "chat_template.jinja").write_text(template)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    _fix_bos_post_processor(out_dir, special.get("bos_token"), bool(add_bos), tokens)


def _fix_bos_post_processor(out_dir: Path, bos: str | None, add_bos: bool, tokens: list[str]) -> None:
    """tokenizer.json decides BOS by its post-processor; make it say what the GGUF says."""
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        data["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    elif data.get("post_processor", {}) and data["post_processor"].get("type") == "TemplateProcessing":
        data["post_processor"] = None
    path.write_text(json.dumps(data, ensure_ascii=False))


# --------------------------------------------------------------------------- weights
def _unpermute(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's `permute()` of Q/K rows (works on weight, scales and biases alike)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _shape(t: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape))  # ggml lists the fastest dimension first


# block layouts: (bytes per block of 32 values, offset of the packed values)
_BLOCKS = {"Q8_0": (34, 2), "Q4_0": (18, 2), "Q4_1": (20, 4)}


def ggml_to_mlx_quantized(t: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """A whole Q4_0/Q4_1/Q8_0 tensor -> MLX affine triple (see `blocks_to_mlx`)."""
    shape = _shape(t)
    raw = np.ascontiguousarray(np.asarray(t.data, dtype=np.uint8)).reshape(-1, _row_bytes(t, shape[-1]))
    w, d, bias, bits = blocks_to_mlx(tensor_type_name(t), raw, shape[-1])
    lead = shape[:-1]
    return w.reshape(*lead, -1), d.reshape(*lead, -1), bias.reshape(*lead, -1), bits


def blocks_to_mlx(kind: str, raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Rows of Q4_0/Q4_1/Q8_0 blocks (uint8, one row per line) -> MLX affine (packed uint32 weight,
    fp16 scales, fp16 biases, bits), row for row.

    Exact: Q8_0 x = d*q (q int8) is scale d, bias -128d on q+128; Q4_0 x = d*(q-8) is scale d,
    bias -8d; Q4_1 x = d*q + m is scale d, bias m. MLX packs values little-end first in uint32."""
    block, off = _BLOCKS[kind]
    rows = raw.shape[0]
    b = raw.reshape(rows, cols // 32, block)
    d = b[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        q = (b[..., off:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        packed, bits, bias = q, 8, (-128.0 * d.astype(np.float32)).astype(np.float16)
    else:
        qs = b[..., off:]
        vals = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # element j, then j + 16
        packed = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)
        bits = 4
        if kind == "Q4_0":
            bias = (-8.0 * d.astype(np.float32)).astype(np.float16)
        else:
            bias = b[..., 2:4].copy().view(np.float16)[..., 0]
    weight = np.ascontiguousarray(packed.reshape(rows, -1)).view(np.uint32)
    return weight, d, bias, bits


def _row_bytes(t: Any, cols: int) -> int:
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[t.tensor_type]
    return cols // block * size


# about 32 MB of float32 values per conversion step: what bounds the import's memory, not the model
CHUNK_ELEMENTS = 8 << 20
_ST_DTYPE = {np.dtype(np.uint32): "U32", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}


@dataclass
class SourceTensor:
    """One GGUF tensor seen as rows (every dimension but the last flattened), converted `step` rows at a time."""

    gguf_name: str
    module: str  # HF name without the leaf, e.g. model.layers.0.mlp.gate_proj
    leaf: str  # weight / bias
    kind: str  # ggml type name
    t: Any
    lead: tuple[int, ...]
    cols: int
    permute_heads: int = 0  # llama Q/K: undo llama.cpp's row permutation over this many heads
    norm_offset: float = 0.0

    @property
    def rows(self) -> int:
        return int(np.prod(self.lead)) if self.lead else 1

    @property
    def row_bytes(self) -> int:
        return _row_bytes(self.t, self.cols)

    @property
    def step(self) -> int:
        """Rows per chunk: whole heads for a permuted Q/K, all of a 1-D tensor, else ~CHUNK_ELEMENTS values."""
        if not self.lead:
            return 1
        if self.permute_heads:
            per_head = self.rows // self.permute_heads
            return per_head * max(1, CHUNK_ELEMENTS // (per_head * self.cols))
        return max(1, CHUNK_ELEMENTS // self.cols)

    def read_rows(self, fd: int, r0: int, r1: int) -> np.ndarray:
        n = (r1 - r0) * self.row_bytes
        at = int(self.t.data_offset) + r0 * self.row_bytes
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = os.preadv(fd, [view[got:]], at + got)
            if k == 0:
                raise GGUFImportError(
                    f"{self.gguf_name}: the file ends inside this tensor; download it again"
                )
            got += k
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, at, n, os.POSIX_FADV_DONTNEED)  # read once: do not let it fill the cache
        return np.frombuffer(buf, dtype=np.uint8).reshape(r1 - r0, self.row_bytes)

    def convert(self, raw: np.ndarray) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, int] | None]:
        """Rows of raw GGUF bytes -> {suffix: (array with one line per row, safetensors dtype)}, quant entry."""
        import mlx.core as mx

        rows = raw.shape[0]
        quant = None
        if self.kind in _MLX_NATIVE_QUANT:
            w, sc, bi, bits = blocks_to_mlx(self.kind, raw, self.cols)
            parts = {"weight": w, "scales": sc, "biases": bi}
            quant = {"group_size": 32, "bits": bits}
        elif self.kind in _MLX_NATIVE_PLAIN:
            dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[self.kind]
            parts = {self.leaf: raw.view(dt).reshape(rows, self.cols)}
        else:
            from gguf import quants

            w = np.asarray(quants.dequantize(raw, self.t.tensor_type), dtype=np.float32).reshape(
                rows, self.cols
            )
            bits = _REQUANT_BITS[self.kind]
            if self.lead and self.cols % 64 == 0:
                wq, scales, biases = mx.quantize(mx.array(w), group_size=64, bits=bits)
                parts = {"weight": np.array(wq), "scales": np.array(scales), "biases": np.array(biases)}
                quant = {"group_size": 64, "bits": bits}
            else:
                parts = {self.leaf: np.array(mx.array(w).astype(mx.float16))}
            del w
        out: dict[str, tuple[np.ndarray, str]] = {}
        for suffix, arr in parts.items():
            dtype = "BF16" if arr.dtype == np.uint16 else _ST_DTYPE[arr.dtype]
            if not self.lead:
                arr = arr.reshape(-1)
            if self.permute_heads:
                heads = self.permute_heads if not self.lead else rows // (self.rows // self.permute_heads)
                arr = _unpermute(arr, heads)
            if self.norm_offset and suffix == "weight":
                m = mx.array(arr)
                m = m.view(mx.bfloat16) if dtype == "BF16" else m
                arr, dtype = np.array(m.astype(mx.float32) - self.norm_offset), "F32"
            out[suffix] = (np.ascontiguousarray(arr), dtype)
        return out, quant


def source_tensors(gf: GGUFFile, spec: ArchSpec, config: dict[str, Any]) -> list[SourceTensor]:
    """The model's tensors in the order they are written: by layer; in a layer its FFN projections
    gate, up, down next to each other (a dense FFN is one contiguous byte range: docs/flash.md)."""
    arch = gf.architecture
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = []
    for name, t in gf.tensors.items():
        if _SKIP.match(name):
            continue
        target = hf_name(name, arch)
        if target is None:
            log.warning("skipping unknown tensor %s", name)
            continue
        module, leaf = target.rsplit(".", 1)
        shape = _shape(t)
        permute = 0
        if spec.permute_qk and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            permute = heads if module.endswith("q_proj") else kv_heads
        offset = spec.norm_offset if module.endswith("norm") else 0.0
        out.append(
            SourceTensor(name, module, leaf, tensor_type_name(t), t, shape[:-1], shape[-1], permute, offset)
        )
    return sorted(out, key=_write_order)


_FFN_ORDER = {"gate_proj": 0, "up_proj": 1, "gate_up_proj": 1, "down_proj": 2}


def _write_order(s: SourceTensor) -> tuple[int, int, int, str]:
    m = re.match(r"model\.layers\.(\d+)\.(.*)$", s.module)
    if not m:
        return (-1 if "embed" in s.module else 1 << 30, 0, 0, s.module)
    proj = m[2].rsplit(".", 1)[-1]
    in_ffn = m[2].startswith("mlp.") and proj in _FFN_ORDER
    return (int(m[1]), int(in_ffn), _FFN_ORDER.get(proj, 0) if in_ffn else 0, m[2])


def _probe(s: SourceTensor, fd: int) -> tuple[list[TensorSpec], dict[str, int] | None]:
    """The output tensors of `s` (names, dtypes, shapes), from converting its first chunk."""
    step = min(s.step, s.rows)
    parts, quant = s.convert(s.read_rows(fd, 0, step))
    specs = []
    for suffix, (arr, dtype) in parts.items():
        shape = (*s.lead, *arr.shape[1:]) if s.lead else arr.shape
        specs.append(TensorSpec(f"{s.module}.{suffix}", dtype, tuple(int(d) for d in shape)))
    return sorted(
        specs, key=lambda t: t.name
    ), quant  # biases, scales, weight: the order a split's unit holds them


def write_weights(
    gf: GGUFFile,
    sources: list[SourceTensor],
    out_dir: Path,
    shard_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict[str, int]]:
    """Convert `sources` chunk by chunk into sharded safetensors in `out_dir`; returns the quantization
    entries per module. Memory: one chunk of one tensor (and its conversion) at a time."""
    from .shards import SHARD_BYTES, ShardWriter, plan_shards

    fd = os.open(gf.path, os.O_RDONLY)
    try:
        groups, quant = [], {}
        for s in sources:
            specs, q = _probe(s, fd)
            groups.append(specs)
            if q:
                quant[s.module] = q
        writer = ShardWriter(out_dir, plan_shards(groups, shard_bytes or SHARD_BYTES))
        try:
            for s, specs in zip(sources, groups, strict=True):
                done = 0
                for r0 in range(0, s.rows, s.step):
                    r1 = min(s.rows, r0 + s.step)
                    parts, _ = s.convert(s.read_rows(fd, r0, r1))
                    for spec in specs:
                        arr, dtype = parts[spec.name.rsplit(".", 1)[1]]
                        if dtype != spec.dtype:
                            raise GGUFImportError(
                                f"{s.gguf_name}: chunk at row {r0} converts to {dtype}, not {spec.dtype}"
                            )
                        writer.write(spec.name, r0 * (spec.nbytes // s.rows), arr.data)
                    del parts
                    if progress:
                        progress((r1 - r0) * s.row_bytes)
                    done = r1
                assert done == s.rows
            writer.finish()
        finally:
            writer.close()
    finally:
        os.close(fd)
    return quant


def _phi3_rope(gf: GGUFFile, config: dict[str, Any]) -> None:
    long_f, short_f = gf.tensors.get("rope_factors_long.weight"), gf.tensors.get("rope_factors_short.weight")
    if long_f is not None and short_f is not None:
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": np.asarray(long_f.data, dtype=np.float32).ravel().tolist(),
            "short_factor": np.asarray(short_f.data, dtype=np.float32).ravel().tolist(),
        }


def _quant_config(quant: dict[str, dict[str, int]]) -> dict[str, Any] | None:
    if not quant:
        return None
    combos = [(q["group_size"], q["bits"]) for q in quant.values()]
    group, bits = max(set(combos), key=combos.count)
    cfg: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for module, q in quant.items():
        if (q["group_size"], q["bits"]) != (group, bits):
            cfg[module] = dict(q)
    return cfg


# --------------------------------------------------------------------------- import
def default_name(path: Path) -> str:
    stem = path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.stem
    return re.sub(r"[^a-z0-9._-]+", "-", stem.lower().replace(".", "-")).strip("-") or "model"


def validate_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", name) or ".." in name:
        raise GGUFImportError(
            f"model name {name!r} is not allowed: use letters, digits, '.', '_' and '-' (max 128), "
            "starting with a letter or digit"
        )
    return name


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        pos = 0
        while block := fh.read(chunk):
            h.update(block)
            if hasattr(os, "posix_fadvise"):  # read once: keep the page cache (and a cgroup's charge) small
                os.posix_fadvise(fh.fileno(), pos, len(block), os.POSIX_FADV_DONTNEED)
            pos += len(block)
    return h.hexdigest()


def _sweep_stale_imports(models_root: Path) -> None:
    """Remove the temporary directories of imports whose process is gone (killed: SIGKILL, OOM)."""
    for d in models_root.glob(".*.importing-*"):
        m = re.search(r"\.importing-(\d+)-", d.name)
        if not m:
            continue
        try:
            os.kill(int(m[1]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        log.info("removing %s, left by an interrupted import", d)
        shutil.rmtree(d, ignore_errors=True)


def import_gguf(
    path: str | Path,
    models_root: Path,
    name: str | None = None,
    overwrite: bool = False,
    show_progress: bool = True,
    shard_bytes: int | None = None,
    sha256: str | None = None,
) -> Path:
    """Import `path` into `models_root/<name>`; returns the model directory. Tensors are converted and
    written one chunk at a time (memory does not grow with the model) into a temporary directory that
    is renamed into place at the end: an interrupted import leaves nothing behind. `sha256`: the file's,
    when the caller already hashed it (recorded with its path, size and mtime: engine.placement)."""
    from tqdm import tqdm

    path = Path(path).expanduser().resolve()
    name = validate_name(name or default_name(path))  # before the file is read: seconds for a large one
    target = models_root / name
    if target.exists() and not overwrite:
        raise GGUFImportError(f"a model named {name!r} already exists in {models_root}: pass --name NEW_NAME")
    gf = read_gguf(path)
    spec = check_supported(gf)
    shapes = {n.rsplit(".", 1)[0]: tuple(int(d) for d in reversed(t.shape)) for n, t in gf.tensors.items()}
    assert spec.build is not None
    config = spec.build(gf.metadata, gf.architecture, shapes)
    config["model_type"] = spec.model_type

    models_root.mkdir(parents=True, exist_ok=True)
    _sweep_stale_imports(models_root)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.importing-{os.getpid()}-", dir=models_root))
    tmp.chmod(0o755)
    try:
        sources = source_tensors(gf, spec, config)
        total = sum(s.rows * s.row_bytes for s in sources)
        with tqdm(total=total, desc=f"importing {path.name}", unit="B", unit_scale=True,
                  disable=not show_progress) as bar:  # fmt: skip
            quant = write_weights(gf, sources, tmp, shard_bytes, bar.update)
        _phi3_rope(gf, config)
        qcfg = _quant_config(quant)
        if qcfg:
            config["quantization"] = qcfg
            config["quantization_config"] = qcfg
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        build_tokenizer(gf, tmp)
        meta = {
            "name": name,
            "architecture": gf.architecture,
            "source_gguf": str(path),
            "source_sha256": sha256 or sha256_file(path),
            "source_size": path.stat().st_size,  # with the path and mtime: the same file, unread
            "source_mtime_ns": path.stat().st_mtime_ns,
            "source_file_type": int(gf.metadata.get("general.file_type", -1)),
            "importer_version": IMPORTER_VERSION,
            "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / "flashcode.json").write_text(json.dumps(meta, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
