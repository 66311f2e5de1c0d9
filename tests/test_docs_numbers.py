"""The headline numbers the docs quote are the ones in bench/results/: a benchmark rerun by its script
changes its file, and this test then names the sentence to update (an audit found six docs quoting
files that had since been regenerated)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _json(name: str) -> dict[str, Any]:
    return json.loads((ROOT / "bench" / "results" / name).read_text())


def _doc(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / name).read_text())  # a number may sit across a line break


# (doc, results file, what the doc must say, made from the file)
QUOTES: list[tuple[str, str, Callable[[dict[str, Any]], str]]] = [
    ("docs/contexts.md", "resume.json", lambda r: f"**{r['resume_speedup_4k']:.0f}×** (`resume_speedup_4k`"),
    (
        "docs/contexts.md",
        "resume.json",
        lambda r: f"| 8,000 tokens | {r['sizes']['8000']['reprefill_s']:.0f} s",
    ),
    (
        "docs/projects.md",
        "projects.json",
        lambda r: f"**`reopen_ttft_ratio` {r['backends']['llama']['reopen_ttft_ratio']:.3f}**",
    ),
    (
        "docs/projects.md",
        "projects.json",
        lambda r: f"**`reopen_ttft_ratio` {r['backends']['mlx']['reopen_ttft_ratio']:.3f}**",
    ),
    ("docs/llama-server.md", "llama.json", lambda r: f"**`decode_ratio` {r['decode_ratio']:.3f}**"),
    (
        "docs/llama-server.md",
        "llama.json",
        lambda r: f"`paired_decode_ratio`, {r['paired_decode_ratio']:.3f}",
    ),
    ("docs/flash.md", "flash-reader-gpu.json", lambda r: f"alone **{r['inplace_vs_copy']:.3f}** of the copy"),
    ("docs/flash.md", "flash-reader-gpu.json", lambda r: f"GIL busy **{r['inplace_vs_copy_gil_busy']:.3f}**"),
    (
        "docs/flash.md",
        "flash-residency.json",
        lambda r: f"**peak RSS {r['import']['import_peak_rss_bytes'] / 1e6:.0f} MB for the",
    ),
    ("docs/cpu.md", "mlx.json", lambda r: f"`prefill_ratio_vs_llama` {r['prefill_ratio_vs_llama']:.2f}"),
    (
        "docs/websocket.md",
        "websocket.json",
        lambda r: (
            f"**{r['backends']['llama']['chat']['ttft_added_ms']:.1f} ms (llama-server) and "
            f"{r['backends']['mlx']['chat']['ttft_added_ms']:.1f} ms (MLX) for chat replies**"
        ),
    ),
    (
        "docs/flash-moe.md",
        "flash-moe.json",
        lambda r: f"**ttft_ratio_vs_llama {r['ttft_ratio_vs_llama']:.2f}**",
    ),
    (
        "docs/flash-moe.md",
        "flash-moe-gpu.json",
        lambda r: f"ceiling_ratio {r['ceiling_ratio_skewed']:.3f} skewed",
    ),
    ("docs/flash-moe.md", "flash-moe-gpu.json", lambda r: f"and {r['ceiling_ratio_uniform']:.3f} uniform"),
    (
        "docs/agent.md",
        "agent.json",
        lambda r: f"llama-server constrained **{r['success_rate']['llama']['constrained']}**",
    ),
    (
        "docs/agent.md",
        "agent-files.json",
        lambda r: f"{r['success_rate']['llama']['constrained']} of the tasks",
    ),
    (
        "docs/agent.md",
        "agent-files-at.json",
        lambda r: (
            f"**{r['success_rate']['llama']['constrained']}** of the tasks in the task's message and "
            f"{r['success_rate']['llama']['constrained-filesys']} in the system prompt"
        ),
    ),
    (
        "docs/agent.md",
        "agent-edit-hint.json",
        lambda r: (
            f"**{r['success_rate']['llama']['constrained']}** with the lines and "
            f"{r['success_rate']['llama']['constrained-noshow']} without"
        ),
    ),
]


@pytest.mark.parametrize(("doc", "results", "quote"), QUOTES, ids=[f"{d}:{r}" for d, r, _ in QUOTES])
def test_the_doc_quotes_its_results_file(
    doc: str, results: str, quote: Callable[[dict[str, Any]], str]
) -> None:
    expected = quote(_json(results))
    assert expected in _doc(doc), f"{doc} should say {expected!r}, as bench/results/{results} does"
