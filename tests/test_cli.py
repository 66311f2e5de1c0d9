"""The CLI contract, run as a user would: the installed `flashcode` script in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FLASHCODE = shutil.which("flashcode", path=str(Path(sys.executable).parent)) or "flashcode"


def flashcode(
    *args: str, home: Path, input: str | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {**os.environ, "FLASHCODE_HOME": str(home)}
    return subprocess.run(
        [FLASHCODE, *args], capture_output=True, text=True, env=env, input=input, timeout=timeout
    )


@pytest.mark.slow
def test_ask_json_answers_paris(model_home):
    proc = flashcode("ask", "--backend", "mlx", "--temperature", "0", "--json",
                     "Which city is the capital of France?", home=model_home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"text", "backend", "model", "prompt_tokens", "completion_tokens", "ttft_s", "prompt_tps",
            "decode_tps", "peak_rss_bytes"} <= set(out)  # fmt: skip
    assert "Paris" in out["text"] and out["backend"] == "mlx" and out["model"] == "smollm2-135m-instruct-q4_1"
    assert out["completion_tokens"] > 0 and out["decode_tps"] > 0 and out["peak_rss_bytes"] > 0


@pytest.mark.slow
def test_ask_default_backend_prints_the_reply(model_home):
    proc = flashcode("ask", "--temperature", "0", "Which city is the capital of France?", home=model_home)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


@pytest.mark.slow
def test_ask_raw_completion(model_home):
    proc = flashcode("ask", "--backend", "mlx", "--raw", "--temperature", "0", "--max-tokens", "8", "--json",
                     "def fibonacci(n):", home=model_home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["completion_tokens"] == 8


def test_models_lists_name_architecture_size(model_home):
    proc = flashcode("models", home=model_home)
    assert proc.returncode == 0
    row = next(line for line in proc.stdout.splitlines() if line.startswith("smollm2-135m-instruct-q4_1"))
    name, arch, size = row.split("\t")
    assert arch == "llama" and size.endswith("MB")


def test_import_prints_name_and_bad_file_exits_with_message(tmp_path, model_home):
    from tests.gguf_factory import write_tiny_gguf

    write_tiny_gguf(tmp_path / "Tiny-Model.Q8_0.gguf")
    home = tmp_path / "home"
    proc = flashcode("import", str(tmp_path / "Tiny-Model.Q8_0.gguf"), "--quiet", home=home)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "tiny-model-q8_0"
    proc = flashcode(
        "import", str(tmp_path / "Tiny-Model.Q8_0.gguf"), "--name", "other", "--quiet", home=home
    )
    assert proc.stdout.strip() == "other"
    assert "tiny-model-q8_0" in flashcode("models", home=home).stdout
    (tmp_path / "notes.txt").write_text("hello")
    proc = flashcode("import", str(tmp_path / "notes.txt"), home=home)
    assert proc.returncode == 2 and "not a GGUF file" in proc.stderr and "Traceback" not in proc.stderr
    # a name taken is refused before the file is read (here: a file that is no GGUF, which would say so)
    proc = flashcode("import", str(tmp_path / "notes.txt"), "--name", "other", home=home)
    assert proc.returncode == 2 and "a model named 'other' already exists" in proc.stderr
    # a damaged model says so in the list (llama-server would load its intact GGUF and answer regardless)
    weights = next((home / "models" / "other").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    rows = {r.split("\t")[0]: r for r in flashcode("models", home=home).stdout.splitlines()}
    assert "\tDAMAGED: " in rows["other"] and "DAMAGED" not in rows["tiny-model-q8_0"]


def test_unknown_model_says_how_to_fix(model_home):
    proc = flashcode("ask", "--backend", "mlx", "--model", "no-such-model", "hi", home=model_home)
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "flashcode import" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_sampling_value_is_rejected(model_home):
    proc = flashcode("ask", "--backend", "mlx", "--temperature", "-1", "hi", home=model_home)
    assert proc.returncode != 0 and "temperature" in proc.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("serve", "--port", "99999"), "'99999' is not a port: use 1-65535"),
        (("rpc-worker", "--host", "10.0.0.2", "--port", "-1"), "'-1' is not a port"),
        (("ask", "--max-tokens", "-5", "hi"), "'-5' is not a whole number of 1 or more"),
        (("ask", "--top-p", "0", "hi"), "'0' is not a number above 0 and at most 1"),
        (("agent", "--max-tokens", "0", "task"), "'0' is not a whole number of 1 or more"),
        (("synth", "nope"), "invalid choice: 'nope' (choose from 'llama-8b'"),
        (("synth", "tiny", "--layers", "-3"), "'-3' is not a number of layers"),
        (("agent", "--project", ".", "do", "it"), 'goes in quotes: flashcode agent "do it"'),
        (("ask", "say", "hi"), 'goes in quotes: flashcode ask "say hi"'),
        # an option the command does not take: its own --help is the one to read
        (
            ("ask", "--foo", "hi"),
            "flashcode ask: error: unrecognized arguments: --foo\n(`flashcode ask --help`",
        ),
        (("agent", "--max-steps", "0", "--project", ".", "task"), "'0' is not a whole number of 1 or more"),
        (("agent", "--project", ".", "  "), "the task is empty"),
        (("ask", ""), "the prompt is empty"),
        (("agent", "--project", "/etc/hostname", "task"), "is a file, not a directory: pick the folder"),
        (("ask", "--seed", "x", "hi"), "'x' is not a seed: a whole number, 0 or more"),
        # before a command: it said "the following arguments are required: COMMAND" (walkthrough)
        (("--bogus",), "unknown option --bogus: options go after a command (flashcode COMMAND --help)"),
        (("-v", "--bogus", "ask", "hi"), "unknown option --bogus"),
    ],
)
def test_bad_arguments_are_refused_before_any_model_loads(
    tmp_path: Path, args: tuple[str, ...], says: str
) -> None:
    """A value out of range is an argument error (exit 2, one line that says what is accepted), found when the
    command line is read: before a model loads or a port is bound."""
    proc = flashcode(*args, home=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr and "unexpected" not in proc.stderr
    assert not (tmp_path / "models").exists() and not proc.stdout
    assert (
        "usage:" not in proc.stderr and len(proc.stderr.splitlines()) <= 2
    )  # the error, not 16 lines of usage


@pytest.mark.slow
def test_chat_streams_and_exits(model_home):
    proc = flashcode("chat", "--backend", "mlx", "--temperature", "0", "--max-tokens", "16",
                     home=model_home, input="/help\n/model\nWhich city is the capital of France?\n/exit\n")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "bot> " in proc.stdout and "Paris" in proc.stdout
    # /help and a web app command are answered here, not sent to the model (it answered "/help" as a question)
    assert proc.stdout.count("bot> ") == 1, proc.stdout
    assert "you>" not in proc.stdout and proc.stdout.startswith("bot> ")  # piped: no prompt before each reply
    assert proc.stderr.count("Commands: /clear") == 2 and "/model is not a command here" in proc.stderr


def test_text_that_is_not_utf8_is_refused_in_words_and_chat_goes_on(model_home):
    """A review: a Latin-1 file piped into `chat`, or `ask $'caf\\xe9'`, crashed with a tokenizer's TypeError
    (`chat` lost its session). Each says the text is not UTF-8 and how to convert it; `chat` takes the next line."""
    env = {**os.environ, "FLASHCODE_HOME": str(model_home)}

    def run(*a: str | bytes, data: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([FLASHCODE, *a], capture_output=True, input=data, env=env, timeout=300)

    proc = run("chat", "--backend", "mlx", "--temperature", "0", "--max-tokens", "4",
               data=b"caf\xe9 au lait\nSay hi.\n/exit\n")  # fmt: skip
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    assert (
        "flashcode: that line is not UTF-8 text (byte 0xe9): convert it first, e.g. `iconv -f latin1" in err
    )
    assert proc.stdout.decode().count("bot> ") == 1 and "Traceback" not in err and "TypeError" not in err
    for argv, what in [
        (["ask", b"caf\xe9"], "the prompt"),
        (["ask", "--system", b"\xff", "hi"], "--system"),
        (["agent", "--project", str(model_home), "--approve", "none", b"fix caf\xe9"], "the task"),
    ]:
        proc = run(*argv)
        assert proc.returncode == 2 and proc.stderr.decode().startswith(
            f"flashcode: {what} is not UTF-8 text"
        ), (
            argv,
            proc.stderr,
        )


def test_setup_is_idempotent(model_home):
    proc = flashcode("setup", "--quiet", home=model_home, timeout=120)
    assert proc.returncode == 0 and "smollm2-135m-instruct-q4_1" in proc.stdout


def test_flash_moe_options_reach_the_engine(model_home, tmp_path):
    """The MoE opt-ins are flags: the run reports the policy it was given; bad values are refused plainly."""
    proc = flashcode("synth", "moe-tiny", "--out", str(tmp_path / "moe"), "--skew", "2", home=model_home)
    assert proc.returncode == 0, proc.stderr
    proc = flashcode("ask", "--backend", "flash", "--model", str(tmp_path / "moe"), "--memory-budget", "300MB",
                     "--expert-policy", "lfu", "--routing-bias", "2", "--top-k-experts", "3", "--expert-prefetch",
                     "--temperature", "0", "--max-tokens", "4", "--json", "hi", home=model_home)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        out["expert_cache"]["policy"] == "lfu" and 0 <= out["hit_rate"] <= 1 and out["completion_tokens"] == 4
    )
    assert out["experts_prefetched"] >= out["experts_prefetch_used"] >= 0  # its reads, beside the misses
    proc = flashcode("ask", "--backend", "flash", "--routing-bias", "-1", "hi", home=model_home)
    assert proc.returncode == 2 and "not a number of 0 or more" in proc.stderr
    proc = flashcode("ask", "--backend", "llama", "--routing-bias", "1", "hi", home=model_home)
    assert proc.returncode != 0 and "applies to the flash backend, not llama" in proc.stderr


def test_flash_expert_predict_is_a_flag_and_says_what_it_read_ahead(model_home, tmp_path):
    """`--expert-predict UNITS` (exact): the reply's stats count its passes and what it read ahead; with
    `--expert-prefetch` as well the load says to choose one."""
    proc = flashcode("synth", "moe-tiny", "--out", str(tmp_path / "moe"), "--skew", "2", home=model_home)
    assert proc.returncode == 0, proc.stderr
    ask = ("ask", "--backend", "flash", "--model", str(tmp_path / "moe"), "--memory-budget", "300MB",
           "--temperature", "0", "--max-tokens", "4", "--json", "--expert-predict", "4")  # fmt: skip
    proc = flashcode(*ask, "hi", home=model_home)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["completion_tokens"] == 4 and out["predict_passes"] == 3 and out["experts_predicted"] >= 0
    proc = flashcode(*ask[:-1], "100000", "hi", home=model_home)  # a pool larger than the budget says so
    assert (
        proc.returncode == 2
        and "(--expert-predict 100000 takes 6553.6 MB of it: fewer units need less)" in (proc.stderr)
    )
    proc = flashcode(*ask, "--expert-prefetch", "hi", home=model_home)  # said before anything loads
    assert proc.returncode != 0 and proc.stderr.strip() == (
        "flashcode: --expert-predict and --expert-prefetch read ahead two ways: choose one"
    )


def _catches_sigint(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (2 - 1)))  # SIGINT is signal 2: bit 1


def test_ctrl_c_while_the_command_line_loads_says_one_line(tmp_path: Path) -> None:
    """Importing the command line (MLX, transformers) takes a second or so: a Ctrl-C then printed the import's
    traceback (37 lines); it says one line, as a Ctrl-C later does. (Measured with the old entry point: at
    0.1 and 0.25 s a traceback, at 0.5 s the command's own line.)"""
    import signal
    import time

    # an empty bytecode cache: the imports compile from source, seconds long, so the Ctrl-C lands inside them on
    # a quiet machine too (with warm .pyc files they could end first, and the command said "no model is
    # installed": CI saw it once). The interpreter's own start is frozen, not compiled: past it by then
    # and Ctrl-C as a terminal delivers it: a test run started in the background of a shell inherits SIGINT
    # ignored, and so would the command (two fresh-clone runs started that way failed here)
    proc = subprocess.Popen(
        [FLASHCODE, "serve", "--port", "0"],
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
            "FLASHCODE_HOME": str(tmp_path),
            "PYTHONPYCACHEPREFIX": str(tmp_path / "pyc"),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # wait until the command line's own module is compiled: then the console script's guard is in place and the
    # imports under it have begun. Python's SIGINT handler alone is not enough: it is in place before `site` is
    # imported, and a Ctrl-C inside `site` is Python's own fatal error, before any line of ours runs (CI, on a
    # loaded machine, once sent it there 0.25 s after the start)
    started = time.monotonic()
    while not (any((tmp_path / "pyc").rglob("webapp/cli.*.pyc")) and _catches_sigint(proc.pid)):
        assert time.monotonic() - started < 60 and proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and err.strip() == "flashcode: stopped (Ctrl-C)", err
    assert proc.returncode == 130


def test_a_model_is_found_by_the_start_of_its_name(tmp_path: Path) -> None:
    """`/model qwen`, `--model qwen`: the start of one installed name is enough (a new user typed it and was told
    to import a model they had); the start of several names asks for more; anything else says how to fix it."""
    from engine.models import ModelNotFoundError, find_model

    for name in ("qwen2.5-coder-0.5b", "smollm2-135m", "smollm2-360m"):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "config.json").write_text('{"model_type": "llama"}')
    assert find_model("qwen", tmp_path).name == "qwen2.5-coder-0.5b"
    assert find_model("Qwen2.5", tmp_path).name == "qwen2.5-coder-0.5b"
    assert find_model("smollm2-360m", tmp_path).name == "smollm2-360m"  # a whole name that starts another's
    with pytest.raises(ModelNotFoundError, match="could be any of smollm2-135m, smollm2-360m: give more"):
        find_model("smollm2", tmp_path)
    with pytest.raises(ModelNotFoundError, match="not found .*`flashcode import"):
        find_model("llama", tmp_path)
    with pytest.raises(ModelNotFoundError):  # a command that rewrites a model's files names it whole
        find_model("qwen", tmp_path, exact=True)
    # a folder that is no model's is said as a folder, not as an unknown name (it was "model 'somedir' not found")
    (tmp_path / "somedir").mkdir()
    with pytest.raises(ModelNotFoundError, match="somedir is a folder but not a model folder .*config.json"):
        find_model(str(tmp_path / "somedir"), tmp_path)
    (tmp_path / "somedir" / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelNotFoundError, match="flashcode import .*m.gguf"):
        find_model(str(tmp_path / "somedir"), tmp_path)
    # `flashcode serve --model qwen` checks the model before it starts: the same rule
    from webapp.preflight import StartupError, check_model

    (tmp_path / "models" / "qwen2.5-coder-0.5b" / "model.safetensors").write_bytes(b"")
    with pytest.raises(StartupError, match="could be any of smollm2-135m, smollm2-360m"):
        check_model("smollm2", tmp_path)
    with pytest.raises(StartupError) as err:
        check_model("qwen", tmp_path)
    assert "qwen2.5-coder-0.5b" in str(err.value) and "not installed" not in str(err.value)


def test_agent_with_a_model_not_installed_says_so_before_loading(tmp_path: Path) -> None:
    """`flashcode agent --model nope` printed "loading nope (auto backend)…" and then that it does not exist."""
    (tmp_path / "proj").mkdir()
    proc = flashcode(
        "agent", "--model", "nope", "--project", str(tmp_path / "proj"), "task", home=tmp_path / "home"
    )
    assert proc.returncode == 2 and "loading" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("flashcode: model 'nope' is not installed in "), proc.stderr
    # the agent's own model missing (a data directory set up by hand): setup fetches it
    proc = flashcode("agent", "--project", str(tmp_path / "proj"), "task", home=tmp_path / "home")
    assert (
        proc.returncode == 2
        and "the agent's model qwen2.5-coder-0.5b-instruct-q4_k_m is not installed" in proc.stderr
    )
    assert "run `flashcode setup --data-dir" in proc.stderr, proc.stderr


def test_json_commands_that_fail_print_their_error_as_json(tmp_path: Path) -> None:
    """`--json` is for scripts: a failure left stdout empty, so the script's JSON parse failed instead of
    reading what went wrong. Now stdout carries `{"error", "exit_status"}`, and stderr still says it."""
    (tmp_path / "proj").mkdir()
    runs = [
        ("ask", "--json", "--model", "nope", "hi"),
        ("agent", "--json", "--model", "nope", "--project", str(tmp_path / "proj"), "task"),
        ("agent", "--json", "--project", str(tmp_path / "proj"), "  "),
        ("route", "--json", " "),
        (
            "ask",
            "--json",
            "--backend",
            "mlx",
            "--expert-policy",
            "lfu",
            "hi",
        ),  # options refused before a load
        ("ask", "--json", "--backend", "flash", "--expert-predict", "2", "--expert-prefetch", "hi"),
        ("ask", "--json", "--max-tokens", "-5", "hi"),  # an argument error (argparse's): its object too
        ("agent", "--json", "task"),  # no --project
    ]
    for args in runs:
        proc = flashcode(*args, home=tmp_path / "home")
        assert proc.returncode == 2, (args, proc.stderr)
        out = json.loads(proc.stdout)
        assert out["exit_status"] == 2 and out["error"] in proc.stderr, (args, out, proc.stderr)
        assert any(
            w in out["error"]
            for w in ("nope", "is empty", "applies to the flash", "two ways", "-5", "--project")
        ), out
    proc = flashcode("ask", "--model", "nope", "hi", home=tmp_path / "home")  # without --json: stderr only
    assert proc.returncode == 2 and not proc.stdout
    # one object a run: a failure after the command printed its own (closing the engine) is said on stderr only
    import argparse
    import contextlib
    import io

    from webapp.cli import json_error

    args, out = argparse.Namespace(json=True), io.StringIO()
    with contextlib.redirect_stdout(out):
        json_error(args, "first", 1)
        json_error(args, "then closing failed", 2)
    assert [json.loads(line)["error"] for line in out.getvalue().splitlines()] == ["first"]


def test_a_warning_is_a_line_of_flashcodes(model_home: Path) -> None:
    """The engine's warnings came as `WARNING engine.flash.backend: flash: …` beside errors that say
    `flashcode: …`: a warning is said as flashcode's too (with -v, the logger's name as well)."""
    args = (
        "ask",
        "--backend",
        "flash",
        "--memory-budget",
        "400MB",
        "--expert-policy",
        "lfu",
        "--max-tokens",
        "2",
    )
    proc = flashcode(*args, "hi", home=model_home)
    assert proc.returncode == 0, proc.stderr
    said = "flash: --expert-policy lfu ignored: smollm2-135m-instruct-q4_1 has no experts"
    assert f"flashcode: {said}" in proc.stderr and "WARNING" not in proc.stderr
    proc = flashcode("-v", *args, "hi", home=model_home)
    assert f"WARNING engine.flash.backend: {said}" in proc.stderr


def test_bench_scripts_are_named_by_the_command_that_runs_them() -> None:
    """`flashcode bench llama --help` said "usage: llama.py" (runpy names argv[0] after the file): it names
    the command, and so does the `command` a result records."""
    from engine.provenance import provenance

    for what in ("llama", "websocket", "agent", "projects"):
        proc = subprocess.run(
            [str(FLASHCODE), "bench", what, "--help"], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: flashcode bench {what} "), (
            proc.stdout[:200]
        )
    assert (
        provenance(["flashcode bench llama", "--tokens", "3"])["command"]
        == "flashcode bench llama --tokens 3"
    )
    assert provenance(["/a b/bench/x.py", "--out", "c d"])["command"] == "'/a b/bench/x.py' --out 'c d'"


def test_every_option_says_what_it_is_for() -> None:
    """`flashcode X --help` explains each argument (a new user found `task`, `--backend` and `--temperature`
    bare in `flashcode agent --help`)."""
    import argparse

    from webapp import cli

    bare: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    walk(p, f"{name} {sub}")
            elif action.help is None:
                bare.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(cli.build_parser(), "flashcode")
    assert bare == []
