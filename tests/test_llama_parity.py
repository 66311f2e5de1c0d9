"""flashcode's imported model (MLX, from `engine.gguf`) against llama-server on the same GGUF:
the tokenizer must give the same ids (this also checks the GGUF importer's tokenizer), the chat
template the same prompt, and greedy replies are compared token by token (teacher-forced on the MLX side) — measured and written to
tests/artifacts/llama_cross_backend.json, not assumed equal (the kernels differ)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.base import Done, GenerationRequest, SamplingParams, TextDelta

pytestmark = [pytest.mark.llama, pytest.mark.slow]

llama_server = pytest.importorskip("engine.llama_server")
try:
    llama_server.find_llama_server()
except Exception as exc:  # noqa: BLE001
    pytest.skip(f"no llama-server: {exc}", allow_module_level=True)

THREADS = int(os.environ.get("FLASHCODE_TEST_LLAMA_THREADS", "1"))


@pytest.fixture(scope="module")
def llama(default_model, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    b = llama_server.LlamaServerBackend(
        context_length=2048, threads=THREADS, slot_save_path=tmp_path_factory.mktemp("slots")
    )
    b.load(default_model)
    yield b
    b.close()


def parity_strings(special_tokens: list[str]) -> list[str]:
    base = [
        "",
        " ",
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        " \n ",
        "\t\tindented",
        "trailing space ",
        " leading",
        "Hello",
        "Hello world",
        "hello, World!",
        "HELLO WORLD",
        "The quick brown fox jumps over the lazy dog.",
        "It's a dog's life, isn't it?",
        "don't won't can't",
        "e.g. i.e. etc.",
        "Mr. Smith went to Washington.",
        "0",
        "1",
        "12",
        "123",
        "1234",
        "12345",
        "123456789",
        "3.14159",
        "-42",
        "+7",
        "1e10",
        "0x1F",
        "0b1010",
        "2026-11-22",
        "12:35:00",
        "$19.99",
        "50%",
        "1,000,000",
        "10/3 = 3.33",
        "v1.2.3",
        "192.168.0.1",
        "héllo",
        "naïve café",
        "Ünïcödé",
        "日本語のテキスト",
        "中文字符",
        "한국어",
        "Привет, мир",
        "Γειά σου Κόσμε",
        "שלום עולם",
        "مرحبا بالعالم",
        "हिन्दी",
        "ไทย",
        "emoji 🙂",
        "👍🏽👨‍👩‍👧",
        "🚀🔥💯",
        "Ω≈ç√∫˜µ≤≥÷",
        "ﬁ ligature",
        "e\u0301 combining",
        "zero\u200bwidth",
        "non\u00a0breaking",
        "tab\tinside",
        "a\u2028b",
        "€£¥₹",
        "→ ← ↑ ↓",
        "™®©",
        "½ ¼ ¾",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
        "\u00ad soft hyphen",
        "def add(a, b):\n    return a + b\n",
        "for (int i = 0; i < n; i++) {\n\tsum += a[i];\n}",
        "const x = () => { return `tpl ${y}`; };",
        "SELECT * FROM users WHERE id = 1;",
        "#include <stdio.h>",
        "if x == None: pass",
        "    def indented(self):",
        "import numpy as np",
        'print("hi")  # comment',
        '<div class="a">text</div>',
        '{"key": "value", "n": [1, 2, 3]}',
        "key: value\nlist:\n  - a\n  - b",
        "https://example.com/path?q=1&r=2#frag",
        "user@example.com",
        "C:\\Users\\name\\file.txt",
        "/usr/bin/env",
        "```python\ncode\n```",
        "# Heading\n\n- item\n- item",
        "**bold** _it_ `code`",
        "| a | b |\n|---|---|",
        "!!!",
        "???",
        "...",
        "----",
        "====",
        "aaaaaaaaaaaaaaaa",
        "abababababab",
        "    ",
        "\n\n\n\n",
        "\t \t \t",
        "x" * 100,
        "The " * 30,
        "0123456789" * 5,
        "ÄÖÜäöüß",
        "ça va?",
        "Hello\nWorld",
        "a  b   c    d",
        "camelCaseIdentifier",
        "snake_case_identifier",
        "SCREAMING_SNAKE",
        "kebab-case-name",
        "__init__",
        'git commit -m "fix: bug"',
        "ls -la | grep foo > out.txt",
        "rm -rf ./build && make -j4",
        "λx.x",
        "∀x∈ℝ: x²≥0",
        "a^2 + b^2 = c^2",
        "E = mc²",
        "H₂O",
        "α β γ δ",
    ]
    specials = []
    for tok in special_tokens:
        specials += [tok, f"text{tok}more", f" {tok} ", f"{tok}\n", f"{tok}{tok}"]
    specials += [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|im_start|>system\nBe brief.<|im_end|>",
        "<|im_end",
        "|im_start|>",
        "<| im_end |>",
        "<|im_start|x",
    ]
    words = ["hello", "def", "return", "42", "naïve", "日本", "🙂", "<|im_end|>", "\t", "end."]
    prefixes = ["", " ", "  ", "\n", "\n  ", "("]
    combos = [p + w for w in words for p in prefixes]
    out = base + specials + combos
    return list(dict.fromkeys(out))  # unique, order kept


def test_llama_tokenizer_matches_the_imported_tokenizer(llama, mlx_backend, artifacts: Path) -> None:
    specials = [t for t in mlx_backend.tokenizer.all_special_tokens if t.startswith("<")][:12]
    strings = parity_strings(specials)
    assert len(strings) >= 200, len(strings)
    mismatches = []
    for s in strings:
        ours, server = mlx_backend.tokenize(s), llama.tokenize(s)
        if ours != server:
            mismatches.append({"text": s, "mlx": ours, "llama_server": server})
    (artifacts / "llama_tokenizer_parity.json").write_text(
        json.dumps({"strings": len(strings), "mismatches": mismatches}, ensure_ascii=False, indent=1)
    )
    assert not mismatches, f"{len(mismatches)}/{len(strings)} strings differ: " + "; ".join(
        f"{m['text']!r}: mlx {m['mlx']} vs server {m['llama_server']}" for m in mismatches[:10]
    )


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Write a loop"},
        {"role": "assistant", "content": "for i in range(3):\n    print(i)"},
        {"role": "user", "content": "Now in C"},
    ],
    [{"role": "user", "content": "Unicode: 日本語 🙂 naïve"}],
    [{"role": "user", "content": "  spaces\tand\nnewlines  "}],
]


def test_llama_chat_template_matches_the_imported_template(llama, mlx_backend) -> None:
    for conv in CONVERSATIONS:
        assert mlx_backend.apply_chat_template(conv) == llama.apply_chat_template(conv), conv


# raw completions, short: MLX's CPU forward costs ~0.2-0.5 s per token on this shared 2-core machine
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n",
    "Once upon a time,",
    "The three primary colors are",
    "for i in range(10):",
    "SELECT name FROM",
    "The quick brown fox",
    "HTTP stands for",
    "# reverse a list\ndef",
]


def greedy_ids(backend, request: GenerationRequest) -> tuple[list[int], str]:
    ids: list[int] = []
    for ev in backend.stream(request, threading.Event()):
        if isinstance(ev, TextDelta):
            ids += ev.token_ids
        elif isinstance(ev, Done):
            assert ev.error is None, ev.error
            return ids, ev.text
    raise AssertionError("no Done")


def mlx_first_divergence(mlx_backend, prompt: list[int], reply: list[int]) -> dict:
    """Teacher-forced: one MLX forward over prompt + the server's greedy reply; the first position where
    MLX's argmax differs is where MLX's own greedy decoding would leave the server's (the prefixes agree
    up to there). Decoding MLX token by token measured the same positions but costs minutes on CPU."""
    import mlx.core as mx

    logits = mlx_backend.model_obj(mx.array(prompt + reply)[None])[0, len(prompt) - 1 : -1].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    best = mx.argmax(logp, axis=-1).tolist()
    for i, (want, got) in enumerate(zip(reply, best, strict=True)):
        if want != got:
            gap = float(logp[i, got].item() - logp[i, want].item())
            return {
                "first_divergence": i,
                "llama_token": want,
                "mlx_token": got,
                "logprob_gap": round(gap, 4),
            }
    return {"first_divergence": None}


def test_llama_and_mlx_greedy_replies_measured(llama, mlx_backend, artifacts: Path) -> None:
    sampling = SamplingParams(temperature=0.0, max_tokens=10)
    rows = []
    for prompt in PROMPTS:
        prompt_ids = mlx_backend.encode_raw(prompt)
        assert llama.client.tokenize(prompt, add_special=True) == prompt_ids  # what /completion will feed
        srv_ids, srv_text = greedy_ids(llama, GenerationRequest(prompt=prompt, sampling=sampling))
        row = {"prompt": prompt, "llama_tokens": len(srv_ids), "llama": srv_text}
        row.update(mlx_first_divergence(mlx_backend, prompt_ids, srv_ids))
        if row["first_divergence"] is not None:
            row["agreed_text"] = mlx_backend.tokenizer.decode(srv_ids[: row["first_divergence"]])
        rows.append(row)
    identical = sum(r["first_divergence"] is None for r in rows)
    summary = {"prompts": len(rows), "identical": identical, "max_tokens": sampling.max_tokens, "rows": rows}
    (artifacts / "llama_cross_backend.json").write_text(json.dumps(summary, ensure_ascii=False, indent=1))
    print(
        f"\ncross-backend greedy: {identical}/{len(rows)} identical over {sampling.max_tokens} tokens; "
        f"first divergences: {[r['first_divergence'] for r in rows]}; "
        f"log-prob gaps there: {[r.get('logprob_gap') for r in rows]}"
    )
    assert len(rows) >= 10 and all(r["llama_tokens"] for r in rows)


def test_llama_scores_single_token_continuations_like_mlx(llama, mlx_backend) -> None:
    prompt = mlx_backend.encode_raw("Question: is the sky blue? Answer Yes or No.\nAnswer:")
    conts = [mlx_backend.tokenize(w) for w in (" Yes", " No", " Maybe")]
    assert all(len(c) == 1 for c in conts)
    ours, server = mlx_backend.score_continuations(prompt, conts), llama.score_continuations(prompt, conts)
    # "Yes"/"No" are in the server's top-100; "Maybe" is not, and is asked for with more: each one its own
    # log-prob, as MLX's (with the top-100 only, every label outside it got the same floor and they tied)
    assert all(abs(a - b) < 0.1 for a, b in zip(ours, server, strict=True)), (ours, server)
    assert ours.index(max(ours)) == server.index(max(server))
    far = [mlx_backend.tokenize(w) for w in (" chat", " search", " shell")]  # the router's labels, far down
    assert len(set(llama.score_continuations(prompt, far))) == 3, "labels outside the top tokens tied"
