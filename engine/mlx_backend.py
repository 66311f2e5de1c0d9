"""The in-RAM MLX engine: mlx-lm's `stream_generate` over a model loaded whole.

What it knows: mlx-lm (load, chat templates through its TokenizerWrapper, `stream_generate`,
`make_prompt_cache`, KV-cache quantization), and how to keep one conversation's prompt cache warm
between turns (reuse the longest common token prefix, trim the rest).

What it does not know: threads (the worker owns it), HTTP, the database.

On MLX's CPU backend float16/bfloat16 math is 8-40x slower than float32, so on CPU every floating
parameter is cast to float32 after loading; quantized weights stay packed.
"""

from __future__ import annotations

import logging
import resource
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .base import (
    ContextLimitError,
    Done,
    EngineError,
    Event,
    GenerationRequest,
    GenerationStats,
    Message,
    ModelInfo,
    ModelLoadError,
    TextDelta,
)
from .stops import StopFilter

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    pass


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def compute_dtype() -> Any:
    """float32 on the CPU backend (fp16/bf16 are emulated there), float16 on GPUs."""
    import mlx.core as mx

    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def cast_for_device(model: Any) -> None:
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)


class PromptCacheState:
    """The live KV cache of the last request and the tokens it holds."""

    def __init__(self) -> None:
        self.cache: list[Any] | None = None
        self.tokens: list[int] = []

    def reset(self) -> None:
        self.cache, self.tokens = None, []

    def prepare(self, model: Any, prompt: list[int], max_kv_size: int | None = None) -> tuple[list[Any], int]:
        """(cache to use, number of prompt tokens already in it). Always leaves >= 1 token to feed."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        common = 0
        for a, b in zip(self.tokens, prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)
        if self.cache is not None and common > 0:
            excess = len(self.tokens) - common
            if excess == 0 or (can_trim_prompt_cache(self.cache) and trim_prompt_cache(self.cache, excess) == excess):
                self.tokens = self.tokens[:common]
                return self.cache, common
        self.cache = make_prompt_cache(model, max_kv_size=max_kv_size)
        self.tokens = []
        return self.cache, 0

    def record(self, tokens: list[int]) -> None:
        """After a generation: the cache holds `offset` tokens of `tokens` (prompt + reply)."""
        offset = cache_offset(self.cache)
        if self.cache is None or offset > len(tokens):
            self.reset()
        else:
            self.tokens = tokens[:offset]


def cache_offset(cache: list[Any] | None) -> int:
    if not cache:
        return 0
    c = cache[0]
    off = getattr(c, "offset", 0)
    return int(off if isinstance(off, int) else off.item())


class MLXBackend:
    """Backend protocol over mlx-lm, model held in RAM."""

    name = "mlx"

    def __init__(
        self,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        quantized_kv_start: int = 0,
        prefill_step_size: int = 512,
        context_length: int | None = None,
    ) -> None:
        if kv_bits not in (None, 4, 8):
            raise EngineError(f"kv_bits must be 4, 8 or unset (16-bit), got {kv_bits}")
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.quantized_kv_start = quantized_kv_start
        self.prefill_step_size = prefill_step_size
        self._context_override = context_length
        self._model_info: ModelInfo | None = None
        self.model_obj: Any = None
        self.tokenizer: Any = None
        self.config: dict[str, Any] = {}
        self.prompt_cache = PromptCacheState()

    # ------------------------------------------------------------------ protocol
    @property
    def model(self) -> ModelInfo | None:
        return self._model_info

    @property
    def context_length(self) -> int:
        if self._context_override:
            return self._context_override
        return int(self.config.get("max_position_embeddings", 4096))

    def load(self, model: ModelInfo) -> None:
        from mlx_lm import load as mlx_load

        try:
            obj, tok, cfg = mlx_load(str(model.path), return_config=True)
        except FileNotFoundError as exc:
            raise ModelLoadError(f"model files missing in {model.path}: re-import it with `flashcode import`") from exc
        except Exception as exc:
            raise ModelLoadError(f"could not load {model.name} from {model.path}: {exc}") from exc
        cast_for_device(obj)
        self.model_obj, self.tokenizer, self.config = obj, tok, cfg
        self._model_info = model
        self.prompt_cache.reset()

    def tokenize(self, text: str) -> list[int]:
        self._require()
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_raw(self, text: str) -> list[int]:
        """Raw completion prompt: the tokenizer's own BOS rule applies."""
        self._require()
        return list(self.tokenizer.encode(text))

    def apply_chat_template(self, messages: Sequence[Message]) -> list[int]:
        self._require()
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineError(f"model {self.model.name if self.model else '?'} has no chat template: use --raw")
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        if isinstance(ids, dict):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            return self.apply_chat_template(request.messages)
        assert request.prompt is not None
        return self.encode_raw(request.prompt)

    def check_context(self, n_prompt: int, max_tokens: int) -> int:
        """The reply budget that fits; raises when the prompt itself does not fit."""
        ctx = self.context_length
        if n_prompt >= ctx:
            raise ContextLimitError(n_prompt, max_tokens, ctx)
        return min(max_tokens, ctx - n_prompt)

    def stream(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        self._require()
        t0 = time.perf_counter()
        prompt = self.prompt_tokens(request)
        sp = request.sampling
        max_tokens = self.check_context(len(prompt), sp.max_tokens)
        if sp.seed is not None:
            mx.random.seed(sp.seed)
        cache, cached = self.prompt_cache.prepare(self.model_obj, prompt)
        sampler = make_sampler(temp=sp.temperature, top_p=sp.top_p if sp.top_p < 1 else 0.0)
        mx.reset_peak_memory()

        def on_prefill(done: int, total: int) -> None:
            if cancel.is_set():
                raise _Cancelled

        stats = GenerationStats(prompt_tokens=len(prompt), cached_tokens=cached)
        stops = StopFilter(sp.stop)
        generated: list[int] = []
        text_parts: list[str] = []
        fed_eos: list[int] = []
        pending_ids: list[int] = []  # tokens whose text is held back (partial UTF-8, maybe a stop string)
        finish: str = "length"
        last = None
        try:
            for resp in stream_generate(
                self.model_obj,
                self.tokenizer,
                mx.array(prompt[cached:]),
                max_tokens=max_tokens,
                sampler=sampler,
                prompt_cache=cache,
                prefill_step_size=self.prefill_step_size,
                kv_bits=self.kv_bits,
                kv_group_size=self.kv_group_size,
                quantized_kv_start=self.quantized_kv_start,
                prompt_progress_callback=on_prefill,
            ):
                last = resp
                if not stats.ttft_s:
                    stats.ttft_s = time.perf_counter() - t0
                if resp.finish_reason == "stop":  # EOS: not part of the reply, but flush its text
                    fed_eos = [int(resp.token)]  # mlx-lm has already fed it to the cache
                    piece = stops.feed(resp.text)
                    if piece or pending_ids:
                        text_parts.append(piece)
                        yield TextDelta(piece, tuple(pending_ids))
                        pending_ids = []
                    finish = "stop"
                    break
                generated.append(int(resp.token))
                pending_ids.append(int(resp.token))
                piece = stops.feed(resp.text)
                if piece:
                    text_parts.append(piece)
                    yield TextDelta(piece, tuple(pending_ids))
                    pending_ids = []
                if stops.stopped:
                    finish = "stop"
                    break
                if resp.finish_reason is not None:
                    break
                if cancel.is_set():
                    finish = "cancelled"
                    break
        except _Cancelled:
            finish = "cancelled"
        tail = stops.flush()
        if tail or pending_ids:
            text_parts.append(tail)
            yield TextDelta(tail, tuple(pending_ids))
        self.prompt_cache.record(prompt + generated + fed_eos)
        stats.completion_tokens = len(generated)
        stats.total_s = time.perf_counter() - t0
        if last is not None:
            stats.prompt_tps = float(last.prompt_tps)
            stats.decode_tps = float(last.generation_tps)
        stats.peak_memory_bytes = int(mx.get_peak_memory())
        stats.peak_rss_bytes = peak_rss_bytes()
        yield Done(stats, finish, "".join(text_parts))  # type: ignore[arg-type]

    def close(self) -> None:
        import mlx.core as mx

        self.model_obj = self.tokenizer = None
        self.prompt_cache.reset()
        self._model_info = None
        mx.clear_cache()

    # ------------------------------------------------------------------ capabilities
    def score_continuations(self, prompt_tokens: list[int], continuations: list[list[int]]) -> list[float]:
        """Sum of log-probabilities of each continuation after the prompt (one batched forward)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self._require()
        cache = make_prompt_cache(self.model_obj)
        logits = self.model_obj(mx.array(prompt_tokens)[None], cache=cache)[0, -1].astype(mx.float32)
        first = logits - mx.logsumexp(logits)
        scores = []
        for cont in continuations:
            if len(cont) == 1:
                scores.append(float(first[cont[0]].item()))
                continue
            c2 = make_prompt_cache(self.model_obj)
            full = self.model_obj(mx.array(prompt_tokens + cont[:-1])[None], cache=c2)[0].astype(mx.float32)
            lp = full - mx.logsumexp(full, axis=-1, keepdims=True)
            n = len(prompt_tokens)
            scores.append(float(sum(lp[n - 1 + i, t].item() for i, t in enumerate(cont))))
        return scores

    def save_prompt_cache(self, path: Path, metadata: dict[str, str]) -> dict[str, Any]:
        from mlx_lm.models.cache import save_prompt_cache

        if self.prompt_cache.cache is None or not self.prompt_cache.tokens:
            raise EngineError("there is no context to save yet: send a message first")
        meta = dict(metadata)
        meta["token_count"] = str(len(self.prompt_cache.tokens))
        save_prompt_cache(str(path), self.prompt_cache.cache, meta)
        return {"tokens": list(self.prompt_cache.tokens), "metadata": meta}

    def load_prompt_cache(self, path: Path, tokens: list[int] | None = None) -> dict[str, Any]:
        from mlx_lm.models.cache import load_prompt_cache

        cache, meta = load_prompt_cache(str(path), return_metadata=True)
        self.prompt_cache.cache = cache
        self.prompt_cache.tokens = list(tokens or [])
        return {"metadata": meta}

    def _require(self) -> None:
        if self.model_obj is None:
            raise EngineError("no model is loaded: pick one with --model or in the model menu")
