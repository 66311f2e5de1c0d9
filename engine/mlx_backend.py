"""The in-RAM MLX engine: mlx-lm's `stream_generate` over a model loaded whole.

What it knows: mlx-lm (load, chat templates through its TokenizerWrapper, `stream_generate`,
`make_prompt_cache`, KV-cache quantization), and how to keep one conversation's prompt cache warm
between turns (reuse the longest common token prefix, trim the rest).

What it does not know: threads (the worker owns it), HTTP, the database.

On MLX's CPU backend float16/bfloat16 math is 8-40x slower than float32, so on CPU every floating
parameter is cast to float32 after loading; quantized weights stay packed, and their layers take the
dequantize-then-BLAS path for prefill (`engine.cpu_fast`; FLASHCODE_CPU_FAST=0 turns it off).
"""

from __future__ import annotations

import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cpu_fast
from .base import (
    CacheMismatchError,
    ContextLimitError,
    Done,
    EngineError,
    Event,
    GenerationRequest,
    GenerationStats,
    Message,
    ModelInfo,
    ModelLoadError,
    PrefillProgress,
    TextDelta,
    ToolCall,
    emit,
)
from .paths import fsync_path
from .stops import StopFilter

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    pass


def peak_rss_bytes() -> int:
    """This process's peak resident set. Linux: VmHWM, the high-water mark of this process's own memory
    map. (`ru_maxrss` is not: Linux carries it across fork and exec, so a child started by a 1.5 GB
    parent reports 1.5 GB before it has touched a page.) Elsewhere: `ru_maxrss`."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def compute_dtype() -> Any:
    """float32 on the CPU backend (fp16/bf16 are emulated there), float16 on GPUs."""
    import mlx.core as mx

    return mx.float32 if mx.default_device() == mx.cpu else mx.float16


def cast_for_device(model: Any) -> None:
    """On the CPU: float32 parameters, and quantized linears fed many rows dequantize for the BLAS."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        model.set_dtype(mx.float32)
        cpu_fast.patch_model(model)


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
            if excess == 0 or (
                can_trim_prompt_cache(self.cache) and trim_prompt_cache(self.cache, excess) == excess
            ):
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


# --------------------------------------------------------------------------- saved KV files
# A saved context is one safetensors file in mlx-lm's prompt-cache format (`load_prompt_cache` reads
# it), cut to the tokens it holds (the live buffers are padded to 256-token steps), optionally cast
# to float16 or quantized (8/4 bits, group 64). On load it becomes plain KVCache layers in the
# compute dtype again, so a quantized file costs precision only on the saved prefix.
KV_FORMAT = "flashcode-kv/1"


@dataclass(frozen=True)
class KVSnapshot:
    """A live prompt cache copied out (`MLXBackend.snapshot_prompt_cache`), to be written to a file later."""

    layers: list[Any]
    tokens: list[int]
    kv_bits: int | None
    model: str  # the model whose cache it is (a write after a switch of model is refused)
    nbytes: int
    # every layer copied: False when a layer kind `snapshot_cache` keeps as the live object (rotating, arrays
    # caches), which the next request changes in place — such a snapshot must be written before it runs
    detached: bool = True


def tree_arrays(state: Any) -> list[Any]:
    """The arrays in a cache layer's `state` (a tuple of arrays, or of tuples of them when quantized)."""
    if isinstance(state, list | tuple):
        return [a for s in state for a in tree_arrays(s)]
    return [state] if hasattr(state, "nbytes") else []


def snapshot_cache(cache: list[Any], kv_bits: int | None, group_size: int = 64) -> list[Any]:
    """New cache layers holding exactly the live tokens, at `kv_bits` (None: as they are)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if kv_bits not in (None, 16, 8, 4):
        raise EngineError(f"a context is saved at 16, 8 or 4 bits (or as it is), not {kv_bits}")
    out: list[Any] = []
    for c in cache:
        off = c.offset
        if isinstance(c, QuantizedKVCache):
            keys = tuple(x[..., :off, :] for x in c.keys)
            values = tuple(x[..., :off, :] for x in c.values)
            if kv_bits is None or (kv_bits == c.bits and group_size == c.group_size):
                out.append(QuantizedKVCache.from_state((keys, values, off, c.group_size, c.bits)))
                continue
            k = mx.dequantize(*keys, group_size=c.group_size, bits=c.bits)
            v = mx.dequantize(*values, group_size=c.group_size, bits=c.bits)
        elif type(c) is KVCache:
            k, v = c.keys[..., :off, :], c.values[..., :off, :]
        else:
            if kv_bits is not None:
                raise EngineError(
                    f"this model's {type(c).__name__} layers can be saved only as they are: "
                    "save without KV quantization"
                )
            out.append(c)
            continue
        if kv_bits is None:
            out.append(KVCache.from_state((k, v, off)))
        elif kv_bits == 16:
            out.append(KVCache.from_state((k.astype(mx.float16), v.astype(mx.float16), off)))
        else:
            if k.shape[-1] % group_size or v.shape[-1] % group_size:
                raise EngineError(
                    f"head size {k.shape[-1]} is not a multiple of the group size {group_size}: "
                    "save at 16 bits"
                )
            qk = tuple(mx.quantize(k, group_size=group_size, bits=kv_bits))
            qv = tuple(mx.quantize(v, group_size=group_size, bits=kv_bits))
            out.append(QuantizedKVCache.from_state((qk, qv, off, group_size, kv_bits)))
    mx.eval([c.state for c in out])
    return out


def kv_file_metadata(layers: list[Any], kv_bits: int | None, group_size: int) -> dict[str, str]:
    first = layers[0]
    bits = getattr(first, "bits", None)
    if bits is None:
        keys = first.state[0] if first.state else None
        bits = keys.dtype.size * 8 if keys is not None else 16
    meta = {"format": KV_FORMAT, "kv_bits": str(bits), "layers": str(len(layers))}
    if getattr(first, "group_size", None):
        meta["kv_group_size"] = str(first.group_size)
    return meta


def kv_shape(model: Any) -> tuple[int, int | None, int | None]:
    """(layers, KV heads, head size) the model's cache must have; None where the config does not say."""
    args: Any = getattr(model, "args", None)
    n_heads = getattr(args, "num_attention_heads", None)
    heads = getattr(args, "num_key_value_heads", None) or n_heads
    head_dim = getattr(args, "head_dim", None)
    if head_dim is None and n_heads and getattr(args, "hidden_size", None):
        head_dim = args.hidden_size // n_heads
    return len(model.layers), heads, head_dim


def read_kv_file(path: Path) -> tuple[list[Any], dict[str, str]]:
    from mlx_lm.models.cache import load_prompt_cache

    if not path.is_file():
        raise CacheMismatchError(f"saved context file {path} does not exist")
    try:
        layers, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as exc:  # mlx raises RuntimeError/ValueError/KeyError for bad files
        raise CacheMismatchError(f"saved context file {path.name} is damaged or truncated ({exc})") from exc
    return layers, dict(meta)


def restore_cache(
    layers: list[Any], expect: tuple[int, int | None, int | None], dtype: Any, path: Path
) -> list[Any]:
    """Check saved layers against the model's cache shape and turn them into live KVCache layers."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    n_layers, heads, head_dim = expect
    if len(layers) != n_layers:
        raise CacheMismatchError(
            f"{path.name} has {len(layers)} layers and the loaded model {n_layers}: "
            "it was saved with another model"
        )
    out: list[Any] = []
    try:
        for c in layers:
            if isinstance(c, QuantizedKVCache):
                k = mx.dequantize(*c.keys, group_size=c.group_size, bits=c.bits).astype(dtype)
                v = mx.dequantize(*c.values, group_size=c.group_size, bits=c.bits).astype(dtype)
            elif type(c) is KVCache:
                k, v = c.keys.astype(dtype), c.values.astype(dtype)
            else:
                out.append(c)
                continue
            shape_ok = k.ndim == 4 and v.ndim == 4 and k.shape[2] == v.shape[2] == c.offset
            if not shape_ok or (heads and k.shape[1] != heads) or (head_dim and k.shape[3] != head_dim):
                raise CacheMismatchError(
                    f"{path.name} holds KV of shape {tuple(k.shape)}, which does not fit "
                    f"the loaded model ({heads} KV heads of {head_dim}): it was saved "
                    "with another model"
                )
            out.append(KVCache.from_state((k, v, c.offset)))
        mx.eval([c.state for c in out])
    except CacheMismatchError:
        raise
    except Exception as exc:  # a truncated file fails here, when its arrays are first read
        raise CacheMismatchError(f"saved context file {path.name} is damaged or truncated ({exc})") from exc
    return out


class MLXBackend:
    """Backend protocol over mlx-lm, model held in RAM."""

    name = "mlx"
    # True: each token is handed out before the next step is built (engine.decode), for a model whose
    # graph building computes (flash: streamed weights are read, MoE routers read back); False: mlx-lm's
    # loop, which builds step n+1 while token n is handled
    yield_first = False

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
        self.last_passes = 0  # forward passes of the last reply (its prompt's counts as one)

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
            raise ModelLoadError(
                f"model files missing in {model.path}: re-import it with `flashcode import`"
            ) from exc
        except Exception as exc:
            hint = ""
            damaged = isinstance(exc, UnicodeDecodeError) or "safetensors" in str(exc).lower()
            if damaged:  # a cut or overwritten weights file
                hint = ": its files may be damaged (`flashcode doctor` checks that they are whole); import the model again"
            raise ModelLoadError(f"could not load {model.name} from {model.path}: {exc}{hint}") from exc
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

    def apply_chat_template(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]] = (), continue_final: bool = False
    ) -> list[int]:
        self._require()
        if not getattr(self.tokenizer, "chat_template", None):
            raise EngineError(
                f"model {self.model.name if self.model else '?'} has no chat template (a base model): "
                "give it text to continue (completion mode in the chat window, --raw on the command line)"
            )
        extra = {"tools": list(tools)} if tools else {}
        if continue_final:  # the assistant's cut reply goes on: the template up to it, then its text
            *before, last = messages
            text = self.tokenizer.apply_chat_template(
                list(before), add_generation_prompt=True, tokenize=False, **extra
            )
            return list(
                self.tokenizer.encode(text + str(last.get("content") or ""), add_special_tokens=False)
            )
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, **extra)
        if isinstance(ids, dict):  # some transformers versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def prompt_tokens(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            tools = request.tools if self.supports_tools() else ()
            return self.apply_chat_template(request.messages, tools, continue_final=request.continue_final)
        assert request.prompt is not None
        return self.encode_raw(request.prompt)

    def check_context(self, n_prompt: int, max_tokens: int) -> int:
        """The reply budget that fits; raises when the prompt itself does not fit."""
        ctx = self.context_length
        if n_prompt >= ctx:
            raise ContextLimitError(n_prompt, max_tokens, ctx, self.context_fix())
        return min(max_tokens, ctx - n_prompt)

    def context_fix(self) -> str:
        """How to get a larger context, as a prompt too long for it is told ("" : load the model with one)."""
        return ""

    def stream(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        try:
            yield from self._generate(request, cancel)
        finally:  # mlx-lm leaves the next step in flight: let it land before anyone can exit (cpu_fast)
            cpu_fast.synchronize()

    def _generate(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[Event]:
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        from .decode import stream_generate_yield_first

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
            if request.progress:  # (total, total) once, with the first token: the prompt is read
                emit(PrefillProgress(cached + done, cached + total))

        stats = GenerationStats(prompt_tokens=len(prompt), cached_tokens=cached)
        stops = StopFilter(sp.stop)
        splitter, constraint = self._tool_calls(request)
        generated: list[int] = []
        text_parts: list[str] = []
        fed_eos: list[int] = []
        pending_ids: list[int] = []  # tokens whose text is held back (partial UTF-8, maybe a stop string)
        finish: str = "length"
        last = None
        seam: bool | None = None if request.continue_final else False  # a space the detokenizer dropped?
        generate = stream_generate_yield_first if self.yield_first else stream_generate
        step_hook = self._before_step() if self.yield_first else None
        try:
            for resp in generate(
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
                logits_processors=[constraint] if constraint is not None else None,
                **({"before_step": step_hook} if step_hook is not None else {}),
            ):
                last = resp
                if not stats.ttft_s:
                    stats.ttft_s = time.perf_counter() - t0
                if seam is None:
                    seam = self._space_at_seam(prompt, int(resp.token))
                text = resp.text
                if seam and text:  # a continued reply keeps the space its first word starts with
                    text, seam = (text if text.startswith(" ") else " " + text), False
                if resp.finish_reason == "stop":  # EOS: not part of the reply, but flush its text
                    fed_eos = [int(resp.token)]  # mlx-lm has already fed it to the cache
                    piece = stops.feed(text)
                    if piece or pending_ids:
                        text_parts.append(piece)
                        yield TextDelta(piece, tuple(pending_ids))
                        pending_ids = []
                    finish = "stop"
                    break
                generated.append(int(resp.token))
                pending_ids.append(int(resp.token))
                piece = stops.feed(text)
                calls: list[ToolCall] = []
                if splitter is not None:
                    piece, calls = splitter.feed(piece)
                    if splitter.in_call or calls:
                        pending_ids = []  # a call's tokens are not reply text
                if piece:
                    text_parts.append(piece)
                    yield TextDelta(piece, tuple(pending_ids))
                    pending_ids = []
                yield from calls
                if constraint is not None and constraint.complete:
                    finish = "stop"  # the call is closed: end the reply there
                    break
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
        calls = []
        if splitter is not None:
            held, calls = splitter.close()
            tail = held + tail
        if tail or pending_ids:
            text_parts.append(tail)
            yield TextDelta(tail, tuple(pending_ids))
        if finish != "cancelled":
            yield from calls
        if constraint is not None:
            stats.extra["constrained_tokens"] = constraint.masked_tokens
            stats.extra["constraint_ms_per_token"] = (
                1000 * constraint.mask_s / max(constraint.masked_tokens, 1)
            )
        self.prompt_cache.record(prompt + generated + fed_eos)
        stats.completion_tokens = len(generated)
        fix = (
            self.context_fix()
            if finish == "length" and len(prompt) + len(generated) >= self.context_length
            else ""
        )
        if fix:  # the context, not the reply's budget, ended it
            stats.extra["context_fix"] = fix
        # forward passes run (the prompt's counts as one): one per token sampled (the reply's and an EOS);
        # mlx-lm's loop built one step past the last
        self.last_passes = len(generated) + len(fed_eos) + (0 if self.yield_first else 1)
        stats.total_s = time.perf_counter() - t0
        if last is not None:
            stats.prompt_tps = float(last.prompt_tps)
            stats.decode_tps = float(last.generation_tps)
        stats.peak_memory_bytes = int(mx.get_peak_memory())
        stats.peak_rss_bytes = peak_rss_bytes()
        yield Done(stats, finish, "".join(text_parts))  # type: ignore[arg-type]

    def _before_step(self) -> Any:
        """What runs before each decode step's model call (`engine.decode`): None here."""
        return None

    def close(self) -> None:
        import mlx.core as mx

        cpu_fast.synchronize()
        self.model_obj = self.tokenizer = None
        self.prompt_cache.reset()
        self._model_info = None
        mx.clear_cache()

    def _space_at_seam(self, prompt: list[int], token: int) -> bool:
        """Whether `token`, right after `prompt`, starts with a space. mlx-lm's streaming detokenizer
        drops a reply's leading space; a reply that goes on (`continue_final`) needs it at the seam."""
        context = prompt[-8:]
        before = self.tokenizer.decode(context)
        after = self.tokenizer.decode(context + [token])
        return after.startswith(before) and after[len(before) :].startswith(" ")

    # ------------------------------------------------------------------ capabilities
    def supports_tools(self) -> bool:
        """Whether the model's chat template takes tools (mlx-lm found a tool parser for it)."""
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "has_tool_calling", False))

    def _tool_calls(self, request: GenerationRequest) -> tuple[Any, Any]:
        """For a request with tools: the splitter that takes calls out of the text (mlx-lm's tool
        parser for this template) and, when constrained, the llguidance logits processor."""
        from .tool_calls import ToolCallConstraint, ToolCallSplitter

        if not request.tools or request.messages is None or not self.supports_tools():
            return None, None
        tk = self.tokenizer
        splitter = ToolCallSplitter(tk.tool_call_start, tk.tool_call_end, tk.tool_parser, request.tools)
        if not request.constrain_tools:
            return splitter, None
        constraint = ToolCallConstraint(
            tk._tokenizer, tk.tool_call_start_tokens or (), request.tools, request.tool_choice == "required"
        )
        return splitter, constraint

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

    def snapshot_prompt_cache(self, kv_bits: int | None = None) -> KVSnapshot:
        """The live prompt cache as it is now, in arrays of its own (`snapshot_cache`), to write later with
        `save_prompt_cache(..., snapshot=)`: MLX arrays are values, so the next request's cache updates
        leave it as it was (they copy a buffer the snapshot still holds)."""
        self._require()
        cache, tokens = self.prompt_cache.cache, list(self.prompt_cache.tokens)
        if cache is None or not tokens:
            raise EngineError("there is no context to save yet: send a message first")
        if cache_offset(cache) != len(tokens):
            raise EngineError(
                f"the live cache holds {cache_offset(cache)} tokens but records {len(tokens)}: "
                "send another message, then save"
            )
        layers = snapshot_cache(cache, kv_bits, self.kv_group_size)
        nbytes = sum(int(a.nbytes) for c in layers for a in tree_arrays(c.state))
        detached = not any(new is old for new, old in zip(layers, cache, strict=True))
        return KVSnapshot(
            layers, tokens, kv_bits, str(self.model.name if self.model else ""), nbytes, detached
        )

    def save_prompt_cache(
        self,
        path: Path,
        metadata: dict[str, str],
        kv_bits: int | None = None,
        snapshot: KVSnapshot | None = None,
    ) -> dict[str, Any]:
        """Write the live prompt cache (or a `snapshot` of it taken before) to `path`: one safetensors file
        in mlx-lm's prompt-cache format holding only the tokens the cache holds, at its own precision
        (`kv_bits=None`), as float16 (16) or quantized (8 or 4 bits, group 64). Atomic: temp file beside
        `path`, fsync, rename. Returns {"tokens": the token ids it holds, "metadata": what the file
        carries, "bytes": size}."""
        from mlx_lm.models.cache import save_prompt_cache

        if snapshot is None:
            snapshot = self.snapshot_prompt_cache(kv_bits)
        else:
            self._require()
            if self.model is None or snapshot.model != self.model.name:
                raise EngineError(
                    f"the model changed since the cache of {snapshot.model} was taken: not saved"
                )
        layers, tokens, kv_bits = snapshot.layers, snapshot.tokens, snapshot.kv_bits
        meta = {**metadata, **kv_file_metadata(layers, kv_bits, self.kv_group_size)}
        meta["token_count"] = str(len(tokens))
        path = Path(path)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp.safetensors")
        try:
            save_prompt_cache(str(tmp), layers, meta)
            fsync_path(tmp)
            os.replace(tmp, path)
            fsync_path(path.parent)
        finally:
            tmp.unlink(missing_ok=True)
        return {"tokens": tokens, "metadata": meta, "bytes": path.stat().st_size}

    def load_prompt_cache(self, path: Path, tokens: list[int] | None = None) -> dict[str, Any]:
        """Read a file written by `save_prompt_cache` and make it the live prompt cache, so the next
        request prefills only what follows the longest common prefix with `tokens` (the ids the file
        holds; without them nothing is reused). The file is read and checked against the loaded model
        before anything changes: a damaged or foreign file raises CacheMismatchError and leaves the
        live cache as it was."""
        self._require()
        layers, meta = read_kv_file(Path(path))
        expect = kv_shape(self.model_obj)
        cache = restore_cache(layers, expect, compute_dtype(), Path(path))
        offset = cache_offset(cache)
        if tokens is not None and len(tokens) != offset:
            raise CacheMismatchError(
                f"{Path(path).name} holds {offset} tokens but its token list has "
                f"{len(tokens)}: the context is damaged"
            )
        if meta.get("token_count") and int(meta["token_count"]) != offset:
            raise CacheMismatchError(
                f"{Path(path).name} says {meta['token_count']} tokens but holds {offset}: "
                "the context is damaged"
            )
        self.prompt_cache.cache = cache
        self.prompt_cache.tokens = list(tokens) if tokens is not None else []
        return {"metadata": meta, "tokens": offset}

    def _require(self) -> None:
        if self.model_obj is None:
            raise EngineError("no model is loaded: pick one with --model or in the model menu")
