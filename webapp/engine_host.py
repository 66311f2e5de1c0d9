"""The engine of one process: which backend and model, on which thread, and switching them.

`backend_options` turns the command line's engine flags into a backend's constructor keywords;
`make_loaded_backend` builds a backend and loads a model (on the thread that will own it);
`start_worker` puts one on a `Worker` thread. `EngineState` is the web app's view of that worker:
the backend, model and context length read on the worker thread after each (re)load, and
`switch()` to change them. Every feature that generates or shows the model gets the one
`EngineState` that `create_app` made.

What it does not know: HTTP, HTML, the database. MLX runs only on the worker's thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import paths
from engine.base import Backend, BackendUnavailableError, EngineError
from engine.models import find_model
from engine.registry import available_backends, backend_class, backend_factory
from engine.worker import Worker

from .settings import Settings

log = logging.getLogger(__name__)


def default_backend() -> str:
    """Picked by measurement: on Apple Silicon MLX (Metal) is the fast path; on a Linux CPU
    llama.cpp decodes SmolLM2-135M ~10x faster than MLX's CPU backend (97 vs 9 tok/s here),
    so the llama-server backend is the default there when its binary is available."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "mlx"
    try:
        import mlx.core as mx  # heavy: only when the platform does not decide on its own

        if mx.default_device() != mx.cpu:
            return "mlx"
    except Exception:  # noqa: BLE001 - no MLX at all: llama is all there is
        return "llama"
    try:
        from engine.llama_server import find_llama_server  # imports httpx: only when asked

        find_llama_server()
        return "llama"
    except Exception:  # noqa: BLE001
        return "mlx"


def resolve_backend(name: str) -> str:
    return default_backend() if name in ("auto", "", None) else name


def options_for(backend: str, options: dict[str, Any] | None) -> dict[str, Any]:
    """The subset of engine options this backend's constructor takes (flags for another engine
    are kept in settings, so they apply again when the user switches back)."""
    accepted: set[str] = set()
    for klass in backend_class(
        backend, options
    ).__mro__:  # a subclass passing **kwargs up takes its parent's too
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(klass.__init__).parameters
        accepted |= {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
    return {k: v for k, v in (options or {}).items() if k in accepted - {"self"}}


# CLI flag (argparse dest) -> backend constructor keyword
_ENGINE_OPTIONS = {
    "kv_bits": "kv_bits", "memory_budget": "memory_budget", "llama_url": "url", "ctx_size": "context_length",
    "llama_binary": "binary", "llama_threads": "threads", "flash_attn": "flash_attn",
    "cache_type_k": "cache_type_k", "cache_type_v": "cache_type_v", "parallel": "parallel",
    "n_gpu_layers": "n_gpu_layers", "n_cpu_moe": "n_cpu_moe", "expert_policy": "expert_policy",
    "expert_prefetch": "expert_prefetch", "expert_predict": "expert_predict", "top_k_experts": "top_k",
    "routing_bias": "routing_bias", "hosts": "hostfile",
}  # fmt: skip
_BACKEND_OF = {"kv_bits": {"mlx", "flash"}, "memory_budget": {"flash"}, "llama_url": {"llama"},
               "llama_binary": {"llama"}, "llama_threads": {"llama"}, "flash_attn": {"llama"},
               "cache_type_k": {"llama"}, "cache_type_v": {"llama"}, "parallel": {"llama"},
               "n_gpu_layers": {"llama"}, "n_cpu_moe": {"llama"}, "expert_policy": {"flash"},
               "expert_prefetch": {"flash"}, "expert_predict": {"flash"}, "top_k_experts": {"flash"}, "routing_bias": {"flash"},
               "hosts": {"mlx", "flash", "llama"}}  # fmt: skip


def backend_options(args: Any, backend: str | None = None) -> dict[str, Any]:
    """Keyword options for the backend from the engine flags the user gave (an argparse namespace)."""
    opts: dict[str, Any] = {}
    for flag, key in _ENGINE_OPTIONS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if backend is not None and flag in _BACKEND_OF and backend not in _BACKEND_OF[flag]:
            raise EngineError(  # said as a command's error (exit 2; under --json, its object too)
                f"--{flag.replace('_', '-')} applies to the {'/'.join(sorted(_BACKEND_OF[flag]))} backend, not {backend}"
            )
        opts[key] = value
    if opts.get("expert_predict") and opts.get("expert_prefetch"):  # (FlashBackend refuses them too)
        raise EngineError("--expert-predict and --expert-prefetch read ahead two ways: choose one")
    return opts


def make_loaded_backend(backend: str, model: str | None, options: dict[str, Any] | None = None) -> Backend:
    """Build a backend and load a model into it (call on the thread that will own it)."""
    name = resolve_backend(backend)
    if name == "flash" and (options or {}).get("memory_budget") is None:
        options = {**(options or {}), "memory_budget": "auto"}  # flash's default: what the machine can spare
    b = backend_factory(name, **options_for(name, options))()
    b.load(find_model(model))
    return b


def place_model(
    model: str | None,
    backend: str,
    options: dict[str, Any],
    say: Callable[[str], None],
    show_progress: bool = True,
) -> tuple[str, str | None]:
    """(backend, model name) for `--model` and `--backend`: a GGUF path is imported (or the import of the
    same file reused); `--backend auto` runs the model in RAM if it fits with room to spare (against
    `--memory-budget` when given, else what `auto` means here: engine.placement), flash otherwise, and
    `say`s which and why in one line. An explicit backend is kept."""
    from engine.placement import choose_engine, import_or_reuse, is_gguf_path

    if is_gguf_path(model):
        assert model is not None
        info, imported = import_or_reuse(model, paths.models_dir(), show_progress=show_progress)
        say(f"{'imported' if imported else 'already imported:'} {model} as {info.name}")
        model = info.name
    if options.get("hostfile") and backend in ("auto", "", None, "mlx", "flash", "llama"):
        backend = "mlx" if backend in ("auto", "", None) else backend
        how = {
            "mlx": "in RAM (MLX)",
            "flash": "flash (each host streams its own layers from its disk)",
            "llama": "llama-server over llama.cpp's RPC (unauthenticated: a trusted network only)",
        }[backend]
        say(f"{how}, its layers split over the hosts of {options['hostfile']} (--hosts)")
        return backend, model
    if backend not in ("auto", "", None):
        return backend, model
    try:
        info = find_model(model)
    except Exception:  # noqa: BLE001 - not installed: the load says so in its own words
        return resolve_backend(backend), model
    placement = choose_engine(info, default_backend(), options.get("memory_budget"))
    say(placement.line(info.name))
    return placement.backend, model


def start_worker(settings: Settings) -> Worker:
    if not settings.load_model:
        return Worker()
    return Worker(lambda: make_loaded_backend(settings.backend, settings.model, settings.backend_options))


def _read(b: Backend) -> tuple[str, str | None, int, bool]:
    base = bool(b.model) and not b.model.has_chat_template  # type: ignore[union-attr]
    return b.name, b.model.name if b.model else None, int(b.context_length or 0), base


@dataclass
class EngineState:
    """The one source of truth for the loaded model: every feature reads it here, every switch goes
    through `switch` (one at a time: `lock`), and `listeners` are called after each (the chat redraws
    every window's model menu, whoever switched: the menu or a /v1 request)."""

    worker: Worker
    backend: str | None = None
    model: str | None = None
    context_length: int = 0
    options: dict[str, Any] = field(default_factory=dict)  # engine flags from the CLI, kept across switches
    is_base_model: bool = False  # the model has no chat template: completion mode only
    listeners: list[Callable[[], None]] = field(default_factory=list)
    _lock: asyncio.Lock | None = field(default=None, repr=False)

    @property
    def lock(self) -> asyncio.Lock:
        """Held across a switch (and by a /v1 request from its model check to queuing its generation)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def model_and_backend(self) -> tuple[str | None, str | None]:
        return self.model, self.backend

    async def refresh(self) -> None:
        try:
            self.backend, self.model, self.context_length, self.is_base_model = await self.worker.acall(_read)
        except Exception:  # noqa: BLE001 - no backend loaded (tests, or a failed switch)
            self.backend, self.model, self.context_length, self.is_base_model = None, None, 0, False

    def menu_backends(self) -> list[str]:
        """The engines the model menu offers: those importable here, without llama-server when it is not
        installed (nor attached to with --llama-url), and always the one running."""
        backends = available_backends()
        if (
            "llama" in backends
            and not self.options.get("url")
            and not _llama_installed(self.options.get("binary"))
        ):
            backends.remove("llama")
        if self.backend and self.backend not in backends:
            backends.insert(0, self.backend)
        return backends

    def menu_fits(self, infos: list[Any]) -> dict[str, Any]:
        """For the model menu: each installed model's `engine.placement.Placement` (its bytes in RAM, whether
        it fits with room to spare) as if it replaced the loaded one; {} when that cannot be told."""
        from engine.placement import menu_placements

        b = self.worker.backend
        loaded = (b.name, b.model) if b is not None and b.model is not None else None
        try:
            return menu_placements(infos, default_backend(), self.options.get("memory_budget"), loaded)
        except Exception:  # noqa: BLE001 - the menu still lists the models
            log.exception("could not tell which models fit in RAM")
            return {}

    def budget_summary(self) -> str:
        """flash's memory budget: the value given, or auto with how it was derived (the loaded flash engine's
        own, else what auto means now)."""
        from engine.flash.memory import auto_budget

        given = self.options.get("memory_budget")
        b = self.worker.backend
        report = b.memory_report() if self.backend == "flash" and hasattr(b, "memory_report") else {}
        if isinstance(given, int):
            return f"{given / 1e9:.2f} GB (set, not auto)"
        if report.get("memory_budget") and report.get("memory_budget_auto"):
            return f"auto: {report['memory_budget'] / 1e9:.2f} GB = {report['memory_budget_auto']}"
        auto = auto_budget()
        return f"auto: {auto.budget / 1e9:.2f} GB = {auto.detail} (resolved again at each flash load)"

    def placement(self, model: str) -> str:
        """The engine `model` gets when none is named: in RAM if it fits with room to spare, else flash."""
        from engine.placement import choose_engine

        info = find_model(model)
        return choose_engine(info, default_backend(), self.options.get("memory_budget")).backend

    async def switch(self, backend: str, model: str) -> None:
        """Load `model` on `backend` (waits for a switch in progress)."""
        async with self.lock:
            await self.switch_locked(backend, model)

    async def switch_locked(self, backend: str, model: str) -> None:
        """`switch` for a caller holding `lock`. On failure reload what was there before, then re-raise."""
        previous = (self.backend, self.model)
        # a name that is no installed model is said before the loaded one goes (it was unloaded, then loaded
        # again: its cache lost, llama-server restarted)
        try:
            await asyncio.to_thread(find_model, model)
        except Exception:
            self.notify()  # the windows' pickers go back to the model that still answers
            raise
        try:
            await asyncio.to_thread(
                self.worker.switch, lambda: make_loaded_backend(backend, model, self.options)
            )
        except Exception as exc:
            if previous[0] and previous[1]:
                with_previous = previous
                try:
                    await asyncio.to_thread(
                        self.worker.switch, lambda: make_loaded_backend(*with_previous, self.options)
                    )
                except Exception as again:  # noqa: BLE001 - said with the first error
                    log.exception("could not restore %s on %s", previous[1], previous[0])
                    raise EngineError(
                        f"{exc}. The model before it, {previous[1]} on {previous[0]}, could not be loaded again "
                        f"either ({again}): no model is loaded now; pick one in the model menu"
                    ) from exc
            raise
        finally:
            await self.refresh()
            self.notify()

    def notify(self) -> None:
        """Tell the listeners the engine (or its settings) changed."""
        for listener in list(self.listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - a window that cannot be told must not fail the switch
                log.exception("engine listener failed")

    def budget_setting(self) -> str:
        """flash's --memory-budget as the user would type it: auto, or a size."""
        given = self.options.get("memory_budget")
        return f"{given / 1e6:.0f}MB" if isinstance(given, int) else "auto"

    async def set_budget(self, budget: int | str) -> bool:
        """flash's memory budget from now on (auto or bytes); a model on flash is loaded again under it.
        Returns whether it was reloaded."""
        async with self.lock:
            self.options["memory_budget"] = budget
            if self.backend == "flash" and self.model:
                await self.switch_locked("flash", self.model)
                return True
        self.notify()
        return False


_LLAMA_SEEN: dict[str | None, tuple[float, bool]] = {}


def _llama_installed(binary: str | None) -> bool:
    """Whether llama-server can be found (looked up at most every 10 s: `make llama` may install it later)."""
    seen = _LLAMA_SEEN.get(binary)
    if seen is not None and time.monotonic() - seen[0] < 10:
        return seen[1]
    from engine.llama_server import find_llama_server

    try:
        find_llama_server(binary)
        ok = True
    except BackendUnavailableError:
        ok = False
    _LLAMA_SEEN[binary] = (time.monotonic(), ok)
    return ok
