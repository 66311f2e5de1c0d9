"""`flashcode ...`: the command line, a client of the web app and the engines (nothing imports it).

Subcommands here: setup, serve, doctor, import, models, ask, chat; `bench` (`cli_bench.py`), `route`
(`agent_cli.py`), `split` and `synth` (`engine.flash.cli`) register themselves through their
`register(subparsers)`. Imports of the web app and the engines happen inside the command that needs
them (MLX, uvicorn, the app), so `flashcode --help` is instant.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sqlite3
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from engine import paths
from engine.base import Done, EngineError, GenerationRequest, SamplingParams, TextDelta
from engine.flash import cli as flash_cli
from engine.models import DEFAULT_MODEL, human_size
from engine.placement import is_gguf_path
from engine.sessions import ContextStore

from . import agent_cli, cli_bench, cli_changes, cli_conversations, cli_projects, preflight
from .db import remembered_model, storage_problem
from .doctor import doctor_report, format_report, model_problem
from .engine_host import backend_options, make_loaded_backend, place_model, resolve_backend
from .preflight import StartupError, data_dir
from .projects.store import ProjectError
from .units import (
    HELP,
    gpu_layers,
    non_negative_float,
    parse_budget,
    parse_size,
    port_number,
    positive_int,
    probability,
    seed,
    stop_string,
)

__all__ = [
    "backend_options",
    "build_parser",
    "main",
    "parse_size",
]  # parse_size: bench scripts import it here

log = logging.getLogger("flashcode")

SUBCOMMANDS = (  # each adds its parsers
    cli_bench.register,
    flash_cli.register,
    agent_cli.register,
    cli_projects.register,
    cli_conversations.register,
    cli_changes.register,
)


def _data_dir(args: argparse.Namespace) -> None:
    if getattr(args, "data_dir", None):
        os.environ[paths.ENV_HOME] = str(Path(args.data_dir).expanduser().resolve())


# --------------------------------------------------------------------------- setup / serve
def cmd_setup(args: argparse.Namespace) -> int:
    from engine.models import ensure_agent_model, ensure_default_model, human_size

    from .preflight import check_data_dir, data_dir

    check_data_dir(data_dir())  # one sentence for a data directory that cannot be used

    for info in (ensure_default_model(quiet=args.quiet), ensure_agent_model(quiet=args.quiet)):
        print(f"{info.name}\t{info.architecture}\t{human_size(info.size_bytes)}\t{info.path}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Every start-up check runs before uvicorn (webapp.preflight): a failure is one sentence."""
    import uvicorn  # the web stack: only for serve

    from . import security
    from .app import create_app
    from .settings import Settings

    given = preflight.data_dir()
    made = given  # the first folder of it that does not exist yet (None: it all exists)
    while not made.parent.exists():
        made = made.parent
    made = None if given.exists() else made
    root = preflight.check_data_dir(given)
    options = backend_options(args)
    try:
        locked = preflight.lock_data_dir(root)
        preflight.check_database(root)
        # held: no save of another process is in flight (no locks on this file system: nothing is swept)
        freed = ContextStore.sweep_leftovers(root) if locked else 0
        if freed:
            print(f"removed {human_size(freed)} that a save cut short by a crash had left", flush=True)
        project = cli_projects.project_dir(args)  # --project DIR: opened at start (added if new)
        remembered = _remembered_model(args, root, options)
        if remembered is None and not is_gguf_path(args.model):  # (a GGUF is imported below)
            preflight.check_model(args.model or DEFAULT_MODEL, root)
    except StartupError:
        if made is not None:  # a refused start leaves nothing behind: only the empty folders it made go
            preflight.unlock_data_dir(root)
            preflight.remove_empty_tree(made)
        raise
    if remembered is not None:
        backend, model = remembered
    else:
        backend, model = _placed_model(args.model, args.backend, root, options)
    settings = Settings(
        host=args.host,
        port=args.port,
        data_dir=root,
        backend=backend,
        model=model,
        backend_options=options,
        extra_origins=tuple(args.allow_origin or ()),
        project_dir=project,
    )
    try:
        settings.token = security.resolve_token(args.token, settings.local_only)
    except ValueError as exc:
        raise preflight.StartupError(str(exc)) from None
    sock = preflight.bind_socket(args.host, args.port)
    settings.port = sock.getsockname()[1]  # --port 0: the one the system picked

    def load(backend: str, model: str, why: str = "") -> Any:
        print(f"loading {model} on {backend}{why}...", flush=True)  # stdout: stderr carries only the error
        return preflight.load_engine(lambda: make_loaded_backend(backend, model, options), model, backend)

    forget = False  # the model last loaded failed: the next start does not try it again
    try:
        try:
            worker = load(
                backend,
                model,
                " (the model last loaded from the menu; --model picks another)" * bool(remembered),
            )
        except StartupError as exc:
            if remembered is None:
                raise
            print(f"flashcode: {exc}; loading the default model instead", file=sys.stderr, flush=True)
            backend, model = _placed_model(None, "auto", root, options)
            worker, forget = load(backend, model), True
            settings.backend, settings.model = backend, model
    except BaseException:
        sock.close()
        raise
    try:
        try:  # the database is opened (and migrated) here: its failures come before the URL
            app = create_app(settings, worker=worker)
            if forget:
                app.state.flashcode.db.forget_model()
        except sqlite3.Error as exc:
            raise preflight.StartupError(
                ": ".join(preflight.database_problem(paths.database_path(root), exc))
            ) from exc
        if not settings.is_loopback:
            print(
                f"WARNING: listening on {args.host}: anyone who can reach this machine and has the token can use "
                "flashcode, including its shell tool (still behind approval). Use the default 127.0.0.1 unless "
                "you mean it.",
                file=sys.stderr,
            )
        elif settings.foreign_origins:
            print(
                f"pages on {', '.join(settings.foreign_origins)} may use this server (--allow-origin), so it asks "
                "for its token, also through a proxy on this machine: open one of them once with "
                f"/?token={settings.token} (then a cookie carries it)",
                file=sys.stderr,
            )
        sock.listen(2048)  # from here connections wait in the backlog: the printed URL works at once
        urls = security.token_urls(args.host, settings.port, settings.token)
        print(f"flashcode on {urls[0]}" + "".join(f"\n         or {u}" for u in urls[1:]), flush=True)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=settings.port,
            log_level=args.log_level,
            ws_max_size=1 << 20,
        )
        _log_to_file(root)  # after uvicorn set its loggers up: its errors go to the file too
        for name in (
            "uvicorn.access",
            "uvicorn.error",
        ):  # `?token=…` in request lines and websocket handshakes
            logging.getLogger(name).addFilter(security.MaskToken())
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        worker.close()
    return 0


def _placed_model(given: str | None, backend: str, root: Path, options: dict[str, Any]) -> tuple[str, str]:
    """(backend, model) for `--model` (`None`: the default) on `--backend`: a GGUF file is imported once; auto
    puts the model in RAM if it fits with room to spare, on flash otherwise. Checked before anything loads."""
    backend, model = place_model(given or DEFAULT_MODEL, backend, options, lambda t: print(t, flush=True))
    model = model or DEFAULT_MODEL
    preflight.check_model(model, root)
    preflight.check_backend(backend, options)
    return backend, model


def _remembered_model(
    args: argparse.Namespace, root: Path, options: dict[str, Any]
) -> tuple[str, str] | None:
    """With neither --model nor --backend given, the model the user last loaded from the model menu or with
    /model (kept in the database) starts again, on the engine it ran on, if it still can; else None (the
    default loads, and the terminal says why that one does not)."""
    if args.model is not None or args.backend != "auto":
        return None
    last = remembered_model(paths.database_path(root))
    if last is None:
        return None
    backend, model = last
    try:
        preflight.check_model(model, root)
        preflight.check_backend(backend, options)
    except StartupError as exc:
        print(f"flashcode: not loading {model} on {backend}, the model last loaded: {exc}", file=sys.stderr)
        return None
    return last


SERVE_LOG = "serve.log"


def _log_to_file(root: Path) -> None:
    """Warnings and errors of this serve (tracebacks included, uvicorn's too) also go to
    `$FLASHCODE_HOME/logs/serve.log`, rotated at 2 MB with 3 old files kept: what went wrong is still there
    when the terminal is gone."""
    from logging.handlers import RotatingFileHandler

    try:
        handler = RotatingFileHandler(
            paths.logs_dir(root) / SERVE_LOG, maxBytes=2_000_000, backupCount=3, encoding="utf-8"
        )
    except OSError as exc:  # a read-only logs folder: the terminal still has everything
        print(f"flashcode: not logging to a file: {exc}", file=sys.stderr)
        return
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("", "uvicorn"):  # uvicorn's own loggers do not reach the root logger
        logging.getLogger(name).addHandler(handler)


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report(data_dir())  # looked at, never created
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["ok"] else 1


def cmd_rpc_worker(args: argparse.Namespace) -> int:
    """Run llama.cpp's rpc-server on a worker of `--backend llama --hosts` (it serves what it is sent)."""
    from engine.base import BackendUnavailableError
    from engine.hostfile import Host, is_local
    from engine.llama_rpc import find_rpc_server
    from engine.llama_server import find_llama_server

    try:
        local = is_local(args.host)
    except ValueError:
        raise SystemExit(f"flashcode: --host {args.host!r} is not an IP address") from None
    if not local:
        raise SystemExit(f"flashcode: {args.host} is not an address of this machine: give one of its own")
    try:
        binary = find_rpc_server(find_llama_server(args.llama_binary))
    except BackendUnavailableError as exc:
        raise SystemExit(f"flashcode: {exc}") from None
    host = Host(ssh=args.host, ip=args.host, port=args.port)
    print(
        f"serving this machine to llama-server at {host.endpoint}: llama.cpp RPC is NOT authenticated or "
        "encrypted and runs what it is sent; keep this port on a network you trust (docs/distributed.md)",
        file=sys.stderr,
    )
    argv = [str(binary), "-H", args.host, "-p", str(args.port)] + (
        ["-t", str(args.threads)] if args.threads else []
    )
    os.execv(argv[0], argv)
    return 0  # not reached


# --------------------------------------------------------------------------- models
def cmd_import(args: argparse.Namespace) -> int:
    from engine.gguf import import_gguf

    target = import_gguf(
        args.file, paths.models_dir(), name=args.name, overwrite=args.force, show_progress=not args.quiet
    )
    print(target.name)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from engine.models import human_size, list_models

    models = list_models()
    if not models:
        print("no models installed: run `flashcode setup` or `flashcode import FILE.gguf`", file=sys.stderr)
        return 0
    for m in models:  # a damaged one says so (doctor's check): `ask` on llama-server would not notice
        problem = model_problem(m)
        print(
            f"{m.name}\t{m.architecture}\t{human_size(m.size_bytes)}"
            + (f"\tDAMAGED: {problem}" if problem else "")
        )
    return 0


# --------------------------------------------------------------------------- generation
def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options")
    g.add_argument(
        "--kv-bits", type=int, choices=[4, 8], default=None, help="quantize the KV cache (mlx, flash)"
    )
    g.add_argument(
        "--memory-budget",
        type=parse_budget,
        default=None,
        help="flash: hard memory budget of the whole process, e.g. 300MB, or auto (the default: available "
        "memory minus max(1 GB, 10%% of RAM), or the memory cgroup's limit)",
    )
    g.add_argument(
        "--ctx-size", type=positive_int, default=None, help="context length to use (default: the model's)"
    )
    g.add_argument(
        "--hosts",
        metavar="HOSTFILE",
        default=None,
        help="split the model's layers over the machines of a hostfile (the first host is this one): mlx and "
        "flash over mlx.distributed's ring backend (with flash each host streams its own layers under its own "
        "--memory-budget); llama over llama.cpp's RPC (`flashcode rpc-worker` on the others): "
        "docs/distributed.md",
    )
    g.add_argument("--llama-url", default=None, help="llama: attach to a llama-server already running at URL")
    g.add_argument("--llama-binary", default=None, help="llama: path of the llama-server binary to run")
    g.add_argument("--llama-threads", type=positive_int, default=None, help="llama: CPU threads (-t)")
    g.add_argument("--flash-attn", choices=["on", "off", "auto"], default=None, help="llama: flash attention")
    g.add_argument(
        "--cache-type-k", choices=["f16", "q8_0", "q4_0"], default=None, help="llama: K cache type"
    )
    g.add_argument(
        "--cache-type-v",
        choices=["f16", "q8_0", "q4_0"],
        default=None,
        help="llama: V cache type (quantized V needs --flash-attn on)",
    )
    g.add_argument("--parallel", type=positive_int, default=None, help="llama: parallel slots")
    g.add_argument(
        "--n-gpu-layers", type=gpu_layers, default=None, help="llama: layers offloaded to the GPU (-1: all)"
    )
    g.add_argument(
        "--n-cpu-moe", type=int, default=None, help="llama: keep the experts of the first N layers on the CPU"
    )
    g.add_argument(
        "--expert-policy",
        choices=["lru", "lfu", "s3fifo"],
        default=None,
        help="flash, MoE: expert cache policy (default lru)",
    )
    g.add_argument(
        "--expert-prefetch",
        action="store_true",
        default=None,
        help="flash, MoE: read the next layer's likely experts ahead (exact)",
    )
    g.add_argument(
        "--expert-predict",
        type=positive_int,
        default=None,
        metavar="UNITS",
        help="flash, MoE: run each token first on the resident experts and read its likely misses at once, "
        "through UNITS staging experts (exact; for a CUDA GPU, where reads bind: on a CPU it is slower)",
    )
    g.add_argument(
        "--top-k-experts",
        type=positive_int,
        default=None,
        help="flash, MoE: fewer active experts per token than the model's (lossy)",
    )
    g.add_argument(
        "--routing-bias",
        type=non_negative_float,
        default=None,
        help="flash, MoE: router logit bonus for cached experts, e.g. 1.0 (lossy; default 0: off)",
    )


def _sampling(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stop=tuple(args.stop or ()),
        )
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def run_stream(backend: Any, request: GenerationRequest, on_text: Callable[[str], None]) -> Done:
    """Drive a backend on this thread; Ctrl-C cancels the reply instead of killing the process."""
    cancel = threading.Event()
    old = (
        signal.signal(signal.SIGINT, lambda *_: cancel.set())
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        for event in backend.stream(request, cancel):
            if isinstance(event, TextDelta):
                on_text(event.text)
            elif isinstance(event, Done):
                return event
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)
    raise EngineError("the engine ended the stream without a result")


def _placed_backend(args: argparse.Namespace) -> tuple[str, Any]:
    """ask/chat: `--model FILE.gguf` imported once; `--backend auto` picks in RAM or flash (said on stderr,
    stdout carries the reply); then the model loaded."""
    auto = args.backend in ("auto", "", None)
    options = backend_options(args, None if auto else resolve_backend(args.backend))
    say = lambda t: print(t, file=sys.stderr)  # noqa: E731
    name, model = place_model(
        args.model, args.backend, options, say, show_progress=not getattr(args, "json", False)
    )
    return name, make_loaded_backend(name, model, options)


def cmd_ask(args: argparse.Namespace) -> int:
    from engine.mlx_backend import peak_rss_bytes

    if not args.prompt.strip():
        raise StartupError("the prompt is empty: say what to ask")
    preflight.check_text(args.prompt, "the prompt")
    preflight.check_text(args.system or "", "--system")
    cli_projects.enter_project(args)
    name, backend = _placed_backend(args)
    try:
        if args.raw:
            request = GenerationRequest(prompt=args.prompt, sampling=_sampling(args))
        else:
            msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": args.prompt}
            ]
            request = GenerationRequest(messages=tuple(msgs), sampling=_sampling(args))
        printer = (lambda t: None) if args.json else (lambda t: print(t, end="", flush=True))
        done = run_stream(backend, request, printer)
        if done.error:
            print(f"\nflashcode: {done.error}", file=sys.stderr)
            json_error(args, done.error, 1)
            return 1
        s = done.stats
        if args.json:
            out = {
                "text": done.text, "backend": name, "model": backend.model.name if backend.model else None,
                "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                "ttft_s": round(s.ttft_s, 4), "prompt_tps": round(s.prompt_tps, 2),
                "decode_tps": round(s.decode_tps, 2),
                "finish_reason": done.finish_reason, "cached_tokens": s.cached_tokens, **s.extra,
                "peak_rss_bytes": max(s.peak_rss_bytes, peak_rss_bytes()),  # the whole process (flash: since load)
            }  # fmt: skip
            if s.extra.get("memory_budget"):  # flash: peak RSS against --memory-budget
                out["peak_rss_of_budget"] = round(out["peak_rss_bytes"] / s.extra["memory_budget"], 4)
            print(json.dumps(out), flush=True)
            args.json_printed = True
        else:
            print()
            if args.verbose:
                budget = s.extra.get("memory_budget")
                mem = (
                    f", peak RSS {max(s.peak_rss_bytes, peak_rss_bytes()) / 1e6:.0f} / {budget / 1e6:.0f} MB"
                    if budget
                    else ""
                )
                print(f"[{s.completion_tokens} tokens, {s.decode_tps:.1f} tok/s, ttft {s.ttft_s * 1000:.0f} ms{mem}]",
                      file=sys.stderr)  # fmt: skip
        return 0
    finally:
        backend.close()


def _cut(finish_reason: str | None, tokens: int, max_tokens: int) -> str:
    """Why a reply stopped before its end, for `flashcode chat`'s footer ("" when it ended by itself)."""
    if finish_reason != "length":
        return ""
    return f" · cut at --max-tokens {max_tokens}" if tokens >= max_tokens else " · cut: the context is full"


def cmd_chat(args: argparse.Namespace) -> int:
    from .agent.slash import DEFAULT as WEB_COMMANDS

    preflight.check_text(args.system or "", "--system")
    cli_projects.enter_project(args)
    name, backend = _placed_backend(args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    print(
        f"flashcode chat — {backend.model.name} on {name}. /clear resets, /exit or Ctrl-D quits, "
        "Ctrl-C stops a reply, /help says so again.",
        file=sys.stderr,
    )
    prompt = (
        "you> " if sys.stdin.isatty() else ""
    )  # piped input: each reply on its own line, not "you> bot> …"
    try:
        while True:
            try:
                line = input(prompt)
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            if not line.strip():
                continue
            if (
                why := preflight.not_utf8(line, "that line")
            ) is not None:  # a Latin-1 file piped in: say, go on
                print(f"flashcode: {why}", file=sys.stderr)
                continue
            if line.strip() in ("/exit", "/quit"):
                return 0
            if line.strip() == "/clear":
                history = history[:1] if args.system else []
                print("(cleared)", file=sys.stderr)
                continue
            word = line.strip()[1:].lower() if re.fullmatch(r"/[A-Za-z-]+", line.strip()) else ""
            if word in WEB_COMMANDS:  # /help, or a web app command: not the model's words (`/tmp` is)
                said = "" if line.strip() == "/help" else f"{line.strip()} is not a command here. "
                print(
                    f"{said}Commands: /clear resets the conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a "
                    "reply. Anything else is sent to the model. The web app's commands (/shell, /model, …) are "
                    "in `flashcode serve`; `flashcode agent` works on a project.",
                    file=sys.stderr,
                )
                continue
            history.append({"role": "user", "content": line})
            print("bot> ", end="", flush=True)
            done = run_stream(
                backend,
                GenerationRequest(messages=tuple(history), sampling=_sampling(args)),
                lambda t: print(t, end="", flush=True),
            )
            print()
            if done.error:
                print(f"flashcode: {done.error}", file=sys.stderr)
                history.pop()
                continue
            s = done.stats
            print(
                f"  [{s.completion_tokens} tok · {s.decode_tps:.1f} tok/s · ttft {s.ttft_s * 1000:.0f} ms"
                f"{' · stopped' if done.finish_reason == 'cancelled' else ''}"
                f"{_cut(done.finish_reason, s.completion_tokens, args.max_tokens)}]",
                file=sys.stderr,
            )
            history.append({"role": "assistant", "content": done.text})
    finally:
        backend.close()


# --------------------------------------------------------------------------- parser
def add_generation_args(
    p: argparse.ArgumentParser, backends: Sequence[str] = ("auto", "mlx", "llama", "flash")
) -> None:
    p.add_argument(
        "--backend",
        default="auto",
        choices=list(backends),
        help=HELP["backend"],
    )
    p.add_argument(
        "--model", default=None, help="installed model name or model directory (default: the default model)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=512, help=HELP["max_tokens"])
    p.add_argument("--temperature", type=non_negative_float, default=0.7, help=HELP["temperature"])
    p.add_argument("--top-p", type=probability, default=1.0, help=HELP["top_p"])
    p.add_argument("--seed", type=seed, default=None, help=HELP["seed"])
    p.add_argument("--stop", action="append", type=stop_string, help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    p.add_argument(
        "--data-dir",
        default=None,
        help=HELP["data_dir"],
    )


def _add_verbose(p: argparse.ArgumentParser) -> None:
    # SUPPRESS: `flashcode -v serve` and `flashcode serve -v` both work (the subparser keeps the global's value)
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="more logging, and a traceback with any error",
    )


class _Parser(argparse.ArgumentParser):
    """argparse with its error first and alone: the whole usage block (16 lines for `serve`) buried the one line
    that says what is wrong. The subcommands' parsers are of this class too (argparse makes them so)."""

    json_errors = (
        False  # the command line has --json: an error is also said as its JSON object (main sets it)
    )

    def error(self, message: str) -> NoReturn:
        if self.json_errors:  # a script's one object, as a command's failure gives it (json_error)
            print(json.dumps({"error": message, "exit_status": 2}), flush=True)
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists its options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="flashcode", description="A local LLM coding agent with a classic-Mac UI.")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="more logging, and a traceback with any error"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("setup", help="fetch and import the default and agent models (idempotent)")
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_verbose(p)
    p.set_defaults(func=cmd_setup)

    p = sub.add_parser("serve", help="run the web app")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: only this machine can connect; anything else exposes the agent)",
    )
    p.add_argument(
        "--port", type=port_number, default=8000, help="port to listen on (default 8000; 0 picks a free one)"
    )
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.add_argument(
        "--backend", default="auto", choices=["auto", "mlx", "llama", "flash"], help=HELP["backend"]
    )
    p.add_argument("--model", default=None, help="installed model name or model directory to load at start")
    add_engine_args(p)
    p.add_argument(
        "--allow-origin",
        action="append",
        metavar="URL",
        help="also accept pages from this origin (e.g. http://my-mac.local:8000 when using --host 0.0.0.0)",
    )
    p.add_argument(
        "--token",
        default=None,
        help="access token the page, websocket and /v1 require (default: $FLASHCODE_TOKEN, else a random "
        "one when --host is not loopback; printed in the URL)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="server log detail",
    )
    cli_projects.add_project_arg(
        p,
        "open this folder as the project (added to the projects if new; default: the project open last, or "
        "Default): its conversations, allow rules and saved contexts, and where the agent works",
    )
    _add_verbose(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "doctor", help="what is installed and what is missing (run this first when something is off)"
    )
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_verbose(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("import", help="convert a GGUF file into an MLX model directory")
    p.add_argument("file", help="the .gguf file")
    p.add_argument(
        "--name",
        default=None,
        help="the model's name here (default: the file's name in lower case, other characters as -)",
    )
    p.add_argument("--force", action="store_true", help="replace a model of the same name")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("models", help="list installed models")
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("ask", help="one chat turn; prints the reply")
    add_generation_args(p)
    p.add_argument("--raw", action="store_true", help="plain completion of PROMPT, no chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with the reply and stats")
    p.add_argument("prompt", help="the message, in one quoted argument")
    cli_projects.add_project_arg(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("chat", help="interactive terminal chat with streaming")
    add_generation_args(p)
    cli_projects.add_project_arg(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "rpc-worker",
        help="run llama.cpp's rpc-server here for `--backend llama --hosts` on another machine (trusted network only)",
    )
    p.add_argument(
        "--host", required=True, help="this machine's address the main server reaches (not 0.0.0.0)"
    )
    p.add_argument(
        "--port", type=port_number, default=50052, help="the port (default 50052, as in the hostfile)"
    )
    p.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: rpc-server's)")
    p.add_argument("--llama-binary", default=None, help="the llama-server whose rpc-server to run")
    p.set_defaults(func=cmd_rpc_worker)

    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    _Parser.json_errors = "--json" in (sys.argv[1:] if argv is None else argv)
    for word in sys.argv[1:] if argv is None else argv:  # the options before the command
        if not word.startswith("-"):
            break
        if word.split("=")[0] not in parser._option_string_actions:
            # said before argparse, which says "the following arguments are required: COMMAND" for it
            parser.error(f"unknown option {word}: options go after a command (flashcode COMMAND --help)")
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_options_on", False):
        words = next((w for w in ("task", "prompt") if isinstance(getattr(args, w, None), str)), None)
        hint = (
            f' (a {words} of several words goes in quotes: flashcode {args.command} "{args.__dict__[words]} '
            f'{" ".join(extra)}")'
            if words and not any(e.startswith("-") for e in extra)
            else ""
        )
        # said by the subcommand's parser: its --help is the one that lists what it takes
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        own = sub.choices.get(args.command, parser) if sub is not None else parser
        own.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    if extra:  # a bench script's own options (`flashcode bench websocket --runs 3`)
        args.rest = [*extra, *args.rest]
    logging.basicConfig(  # a warning is a line of flashcode's, as its errors are; -v names the logger too
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s" if args.verbose else "flashcode: %(message)s",
    )
    if (
        not args.verbose
    ):  # Ctrl-C while a command runs: "Loop … that handles pid N is closed" says nothing new
        logging.getLogger("asyncio").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _data_dir(args)
    status = _run(args)
    if argv is None and "mlx.core" in sys.modules:
        # MLX can abort in interpreter teardown ("terminate called without an active exception", exit
        # 134) once the engine thread that used it has ended — seen after `serve` and after `agent`: a
        # real process that loaded MLX leaves without teardown (each command has closed what it opened).
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(status)
    return status


def _check_environment() -> None:
    """The numbers a user may set in the environment, checked before anything starts (one sentence)."""
    from engine import paths

    for name in paths.ENV_NUMBERS:
        try:
            paths.env_number(name, 0)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
    home = os.environ.get(paths.ENV_HOME)
    if home and not os.path.isabs(os.path.expanduser(home)):  # commands that chdir into a project
        os.environ[paths.ENV_HOME] = os.path.abspath(os.path.expanduser(home))
    if home and os.path.exists(home) and not os.path.isdir(home):
        raise StartupError(f"the data directory {home} is a file, not a directory: pass another --data-dir")


def _run(args: argparse.Namespace) -> int:
    try:
        _check_environment()
        return int(args.func(args) or 0)
    except BrokenPipeError:  # the reader of the output went away (`| head`): it had what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 0
    except (StartupError, EngineError, RuntimeError, OSError, ProjectError) as exc:
        return _fail(args, str(exc))
    except KeyboardInterrupt:
        print("\nflashcode: stopped (Ctrl-C)", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug: one line, the traceback with -v
        if (problem := storage_problem(exc, paths.database_path())) is not None:  # busy, full, read-only
            return _fail(args, problem)
        return _fail(args, f"unexpected {type(exc).__name__}: {exc} (run again with -v for the traceback)", 1)


def _fail(args: argparse.Namespace, message: str, status: int = 2) -> int:
    """One sentence on stderr; the traceback too with -v. Under --json, stdout carries it too, as the one
    object a script reads (`{"error": ..., "exit_status": ...}`): an empty stdout made its JSON parse fail."""
    if args.verbose:
        traceback.print_exc()
    print(f"flashcode: {message}", file=sys.stderr)
    json_error(args, message, status)
    return status


def json_error(args: argparse.Namespace, message: str, status: int) -> None:
    """`--json`'s object for a command that failed: what went wrong and the exit status it ends with. One object
    a run: none when the command printed its own (a failure after it, closing the engine, is said on stderr)."""
    if getattr(args, "json", False) and not getattr(args, "json_printed", False):
        print(json.dumps({"error": message, "exit_status": status}), flush=True)
        args.json_printed = True


if __name__ == "__main__":
    sys.exit(main())
