"""A `stream_generate` that hands each token out before it builds the next step.

mlx-lm's `generate_step` builds step n+1 (`mx.async_eval`) before it yields token n. For a model whose
graph building is cheap that costs nothing: the device computes step n+1 while the caller handles
token n. The flash engine's graph building is not cheap: a streamed layer waits for its weights' reads,
and a MoE layer reads its router's choice back from the device before it can pick experts. Building
step n+1 there *is* computing it, so with mlx-lm's loop every token (the first included) reached the
user one whole step late, and every reply computed one step nobody used (~2 s a token for the 48-layer
MoE on this CPU).

`stream_generate_yield_first` gives the very same tokens: mlx-lm's own `generate_step` prefills the
prompt and samples the first token (run with `max_tokens=0`, its sampler wrapped to keep the sample);
each later step repeats the ops of mlx-lm's `_step` (the model on the last token, the logits
processors over every token so far, the KV cache's quantization, log-softmax, the sampler) on the
same stream. Its responses are `GenerationResponse`s with `stream_generate`'s fields and timings
(`prompt_tps` up to the first token, `generation_tps` after it).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any


def stream_generate_yield_first(
    model: Any,
    tokenizer: Any,
    prompt: Any,
    *,
    max_tokens: int,
    sampler: Callable[[Any], Any],
    logits_processors: list[Callable[[Any, Any], Any]] | None = None,
    prompt_cache: list[Any] | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    before_step: Callable[[Any, list[Any]], Any] | None = None,
    **prefill: Any,
) -> Iterator[Any]:
    """`mlx_lm.stream_generate(model, tokenizer, prompt, ...)` for an `mx.array` prompt and a
    TokenizerWrapper, each token yielded before the next step is built. `prefill`: the rest of
    `generate_step`'s options (`prefill_step_size`, `prompt_progress_callback`). `before_step(inputs,
    cache)`: called before each later step's model call, on its stream (the flash engine's predict pass,
    which leaves the cache as it found it)."""
    import mlx.core as mx
    from mlx_lm.generate import (
        GenerationResponse,
        generate_step,
        generation_stream,
        maybe_quantize_kv_cache,
        wired_limit,
    )
    from mlx_lm.models.cache import make_prompt_cache

    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    quantize = functools.partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                                 kv_group_size=kv_group_size, kv_bits=kv_bits)  # fmt: skip
    kept: list[tuple[Any, Any]] = []

    def keep(logprobs: Any) -> Any:
        y = sampler(logprobs)
        kept.append((y, logprobs))
        return y

    detokenizer = tokenizer.detokenizer
    eos = tokenizer.eos_token_ids
    with wired_limit(model, [generation_stream]):
        tic = time.perf_counter()
        # the prompt and the first token, by mlx-lm itself: it stops before building a second step
        for _ in generate_step(prompt, model, max_tokens=0, sampler=keep, logits_processors=logits_processors,
                               prompt_cache=cache, kv_bits=kv_bits, kv_group_size=kv_group_size,
                               quantized_kv_start=quantized_kv_start, **prefill):  # fmt: skip
            pass
        y, logprobs = kept[-1]
        tokens = prompt if logits_processors else None  # generate_step's history: the whole prompt
        prompt_tps = 0.0
        n = 0
        while True:
            token = int(y.item())
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in eos:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield GenerationResponse(
                text=detokenizer.last_segment, token=token, logprobs=logprobs.squeeze(0), from_draft=False,
                prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
                generation_tps=(n + 1) / (time.perf_counter() - tic),
                peak_memory=mx.get_peak_memory() / 1e9, finish_reason=None,
            )  # fmt: skip
            with mx.stream(generation_stream):  # mlx-lm's `_step`, op for op
                if before_step is not None:
                    before_step(y[None], cache)
                logits = model(y[None], cache=cache)[:, -1, :]
                if logits_processors:
                    tokens = mx.concat([tokens, y]) if tokens is not None else y
                    for processor in logits_processors:
                        logits = processor(tokens, logits)
                quantize(cache)
                logprobs = logits - mx.logsumexp(logits, keepdims=True)
                y = sampler(logprobs)
            mx.async_eval(y, logprobs)
            n += 1
            if n % 256 == 0:
                mx.clear_cache()
        detokenizer.finalize()
        yield GenerationResponse(
            text=detokenizer.last_segment, token=token, logprobs=logprobs.squeeze(0), from_draft=False,
            prompt_tokens=prompt.size, prompt_tps=prompt_tps, generation_tokens=n + 1,
            generation_tps=(n + 1) / max(time.perf_counter() - tic, 1e-9),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason="stop" if token in eos else "length",
        )  # fmt: skip
