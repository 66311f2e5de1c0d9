"""Tiny GGUF files of each supported architecture, written the way llama.cpp's converter writes them
(Q/K rows permuted for llama, gemma norms stored as 1 + w), with a byte-level vocabulary.

Used to test the importer without a model hub: the Hugging Face-layout weights are kept, so a test
can check that import gives them back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}"
)


def _byte_vocab() -> tuple[list[str], list[str]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = SPECIALS + chars + ["Ġt", "he", "Ġthe"]
    return tokens, merges


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to Q/K of llama-family models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    quant: str = "Q8_0",
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ff: int = 128,
    experts: int = 4,
    seed: int = 0,
    tie: bool = True,
    raw_tensor_type: str | None = None,
) -> dict[str, np.ndarray]:
    """Write a GGUF; returns the Hugging Face-named float32 weights it encodes."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    tokens, merges = _byte_vocab()
    vocab = len(tokens)
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(ff)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(128)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    if arch == "phi3":
        w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    hf: dict[str, np.ndarray] = {}
    qtype = {"Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "F16": Q.F16, "F32": Q.F32}[quant]

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def add(
        gname: str, hname: str, arr: np.ndarray, quantize: bool = True, stored: np.ndarray | None = None
    ) -> None:
        hf[hname] = arr
        data = arr if stored is None else stored
        if quantize and data.ndim >= 2 and qtype not in (Q.F16, Q.F32):
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        elif quantize and qtype == Q.F16:
            w.add_tensor(gname, data.astype(np.float16))
        else:
            w.add_tensor(gname, data.astype(np.float32))

    gemma = arch.startswith("gemma")
    norm = lambda n: np.ones(n, np.float32) + rng.standard_normal(n).astype(np.float32) * 0.1  # noqa: E731

    def add_norm(gname: str, hname: str, n: int) -> None:
        v = norm(n)
        if gemma:  # stored as 1 + w; mlx-lm's gemma RMSNorm adds the 1 itself
            add(gname, hname, v - 1.0, quantize=False, stored=v)
        else:
            add(gname, hname, v, quantize=False)

    add("token_embd.weight", "model.embed_tokens.weight", mat(vocab, hidden))
    add_norm("output_norm.weight", "model.norm.weight", hidden)
    if not tie and not gemma:
        add("output.weight", "lm_head.weight", mat(vocab, hidden))
    for i in range(layers):
        p, g = f"model.layers.{i}", f"blk.{i}"
        add_norm(f"{g}.attn_norm.weight", f"{p}.input_layernorm.weight", hidden)
        q, k, v = (
            mat(heads * head_dim, hidden),
            mat(kv_heads * head_dim, hidden),
            mat(kv_heads * head_dim, hidden),
        )
        if arch == "phi3":
            add(f"{g}.attn_qkv.weight", f"{p}.self_attn.qkv_proj.weight", np.concatenate([q, k, v]))
        else:
            permute = arch == "llama"
            add(
                f"{g}.attn_q.weight",
                f"{p}.self_attn.q_proj.weight",
                q,
                stored=llama_permute(q, heads) if permute else None,
            )
            add(
                f"{g}.attn_k.weight",
                f"{p}.self_attn.k_proj.weight",
                k,
                stored=llama_permute(k, kv_heads) if permute else None,
            )
            add(f"{g}.attn_v.weight", f"{p}.self_attn.v_proj.weight", v)
        if arch == "qwen2":
            for n, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                add(f"{g}.attn_{n}.bias", f"{p}.self_attn.{n}_proj.bias", mat(rows), quantize=False)
        add(f"{g}.attn_output.weight", f"{p}.self_attn.o_proj.weight", mat(hidden, heads * head_dim))
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            add_norm(f"{g}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", head_dim)
            add_norm(f"{g}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", head_dim)
        if gemma:
            add_norm(f"{g}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight", hidden)
            add_norm(f"{g}.ffn_norm.weight", f"{p}.pre_feedforward_layernorm.weight", hidden)
            add_norm(f"{g}.post_ffw_norm.weight", f"{p}.post_feedforward_layernorm.weight", hidden)
        else:
            add_norm(f"{g}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", hidden)
        if arch == "qwen3moe":
            add(f"{g}.ffn_gate_inp.weight", f"{p}.mlp.gate.weight", mat(experts, hidden), quantize=False)
            add(f"{g}.ffn_gate_exps.weight", f"{p}.mlp.switch_mlp.gate_proj.weight", mat(experts, ff, hidden))
            add(f"{g}.ffn_up_exps.weight", f"{p}.mlp.switch_mlp.up_proj.weight", mat(experts, ff, hidden))
            add(f"{g}.ffn_down_exps.weight", f"{p}.mlp.switch_mlp.down_proj.weight", mat(experts, hidden, ff))
        elif arch == "phi3":
            add(f"{g}.ffn_up.weight", f"{p}.mlp.gate_up_proj.weight", mat(2 * ff, hidden))
            add(f"{g}.ffn_down.weight", f"{p}.mlp.down_proj.weight", mat(hidden, ff))
        else:
            add(f"{g}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", mat(ff, hidden))
            add(f"{g}.ffn_up.weight", f"{p}.mlp.up_proj.weight", mat(ff, hidden))
            add(f"{g}.ffn_down.weight", f"{p}.mlp.down_proj.weight", mat(hidden, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf
