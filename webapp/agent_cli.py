"""`flashcode route [--json] PROMPT`: the agent's routing decision for one prompt, with the three
label scores (log-probabilities after the routing prompt). For debugging and evaluation; the web
app routes through the same `webapp.agent.router.route_step`.

`flashcode agent --project DIR [--model NAME] [--backend B] [--approve ask|all|none] [--max-steps N]
[--json] TASK`: one agent task in the terminal through the same `AgentSession` tool loop as the web
app (approvals asked on the terminal with `ask`); `--json` prints one object: answer, steps (tool,
arguments, decision, ok, exit_code) and stats. It works in the data directory's database like the
web app: the project is added to `flashcode projects` if new, and its allow rules, network switch,
MCP servers (`.mcp.json` and Settings) and their approvals are the ones the web app has. A
`.mcp.json` server not approved yet is asked about on the terminal with `ask` (approved for the
project, as in Settings), approved for this run only with `all`, and not started with `none`.
Part of the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import paths
from engine.base import SamplingParams
from engine.placement import is_gguf_path
from engine.worker import Worker

from . import cli_projects, engine_host, preflight, tools_cli
from .agent import events as ev
from .agent.agent import AgentSession
from .agent.loop import DEFAULT_AGENT_MODEL, DEFAULT_MAX_STEPS, ran_to_its_end
from .agent.mcp import Launch, McpServers
from .agent.mcp_store import McpStore
from .agent.router import route_step
from .agent.search import DDGSProvider
from .agent.store import AgentStore
from .agent.visible import GIT_WARNING
from .agent.web import hidden_paths
from .projects.store import ProjectRef
from .render import visible_text
from .settings import default_agent_sampling
from .stats import store as stats_store
from .units import HELP, non_negative_float, positive_int, seed


def cmd_route(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise preflight.StartupError("the prompt is empty: give the message to route")
    if args.data_dir:
        os.environ[paths.ENV_HOME] = os.path.abspath(os.path.expanduser(args.data_dir))
    backend = engine_host.make_loaded_backend(args.backend, args.model)
    try:
        decision = route_step(backend, args.prompt)
        model = backend.model.name if backend.model else None
    finally:
        backend.close()
    if args.json:
        print(
            json.dumps({"prompt": args.prompt, "model": model, "backend": args.backend, **decision.to_dict()})
        )
    else:
        print(decision.route)
        probs = decision.probabilities
        for label, score in decision.scores.items():
            mark = "*" if label == decision.route else " "
            print(f"{mark} {label:<7} logprob {score:8.3f}   {probs[label]:6.1%}")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "route", help="show how the agent routes PROMPT (chat, search or shell) and the label scores"
    )
    p.add_argument("prompt", help="the message to route, in one quoted argument")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None, help="installed model name (default: the default model)")
    p.add_argument(
        "--backend",
        default="mlx",
        choices=["mlx", "llama"],
        help="engine that scores the labels (default mlx; llama uses llama-server's token probabilities)",
    )
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_route)
    register_agent(sub)
    tools_cli.register(sub)  # flashcode tools


# --------------------------------------------------------------------------- flashcode agent
FROM_A_PIPE = (
    "stdin is not a terminal, and what is saved for the project (an allow rule, a server's approval) is "
    "saved only from one: answer in a terminal, or in the web app's Settings"
)


class _Stdin:
    ended_on: object = (
        None  # the stdin whose end ask_terminal met (a closed pipe, /dev/null): nothing more comes
    )

    @classmethod
    def ended(cls) -> bool:
        return cls.ended_on is not None and cls.ended_on is sys.stdin


def ask_terminal(prompt: str) -> str:
    """One line from stdin, the prompt on stderr (stdout is the answer, or the --json object)."""
    print(prompt, end="", file=sys.stderr, flush=True)
    try:
        answer = input()
    except EOFError:
        answer = ""  # no terminal, nothing more typed: no
        _Stdin.ended_on = sys.stdin
    if (
        not sys.stdin.isatty()
    ):  # a piped answer is not echoed: shown, so what follows starts a line of its own
        print(visible_text(answer), file=sys.stderr, flush=True)
    return answer


NO_MORE_INPUT = (
    "denied: nothing more can be typed (stdin has ended); with no terminal to ask on, pass --approve all or "
    "--approve none"
)


def terminal_approval(mode: str) -> Any:
    """The approval callback for `--approve`: all (approve everything), none (deny everything), ask."""

    async def approve(p: ev.Proposal) -> ev.Decision:
        if mode == "all":
            for w in p.warnings:  # said, as the dialog says them
                print(visible_text(f"Warning: {w} ({p.command})"), file=sys.stderr)
            if p.tool == "write" and any(GIT_WARNING in w for w in p.warnings):
                # a write into a git directory (or one that makes a folder one) always asks, even with edits
                # approved automatically: its hooks and config run outside the sandbox at the next git
                return ev.Decision.deny(
                    "--approve all does not approve a write into a git directory (its hooks and config run "
                    "outside the sandbox at your next git); run with --approve ask to decide it"
                )
            return ev.Decision.once()
        if mode == "none":
            return ev.Decision.deny("the agent runs with --approve none")
        what = {"shell": "run", "mcp": "call the MCP tool"}.get(p.tool, "write")
        # the command and the diff are the model's (or a file's): shown with their hidden characters marked, so
        # an escape sequence or a carriage return cannot redraw this prompt; the dialog's warnings come first
        warnings = "".join(f"Warning: {w}\n" for w in p.warnings)
        note = (
            f"\n  (it can only be run once: {p.parse_error})" if p.parse_error and p.tool == "shell" else ""
        )
        print(
            visible_text(
                f"\n{warnings}{p.diff or ''}The agent wants to {what}: {p.command}{note}\n"
                f"  ({p.sandbox or p.rule_text})"
            ),
            file=sys.stderr,
        )
        if p.tool == "mcp":
            print("  Its result reaches the model as untrusted data.", file=sys.stderr)
        # a rule outlives this run: offered only to a terminal (piped, [a]lways was offered, then refused), and
        # the prefix rule the dialog offers too (walkthrough)
        tty = sys.stdin.isatty()
        always = "always_exact" in p.choices
        prefix = p.prefix if "always_prefix" in p.choices and p.prefix else ""
        options = "[y]es once"
        if always and tty:
            options += (
                ", [a]lways this exact command in this project"
                if p.tool == "shell"
                else ", [a]lways in this project"
            )
        if prefix and tty:
            options += f", [p]refix: always `{prefix}` in this project"
        prompt = f"Allow? {options}, or no (Enter, or type why not: the model reads it): "
        # stdin ended (before this question, or at it): denied, and said why, with what to pass instead
        answer = "" if _Stdin.ended() else (await asyncio.to_thread(ask_terminal, prompt)).strip()
        if not answer and _Stdin.ended():
            print(f"  {NO_MORE_INPUT}", file=sys.stderr)
            return ev.Decision.deny("no one could answer (no terminal)")
        if answer.lower() in ("y", "yes"):
            return ev.Decision.once()
        rule = (always and answer.lower() in ("a", "always")) or (
            prefix and answer.lower() in ("p", "prefix")
        )
        if rule and not tty:  # a line of piped text never makes a rule that outlives this run
            print(f"  not allowed: {FROM_A_PIPE}", file=sys.stderr)
            return ev.Decision.deny(f"not allowed: {FROM_A_PIPE}")
        if rule:
            return (
                ev.Decision.always_exact()
                if answer.lower() in ("a", "always")
                else ev.Decision.always_prefix()
            )
        return ev.Decision.deny(answer)

    return approve


def _progress(e: ev._Event) -> None:
    if isinstance(e, ev.ToolStep):
        # the tool's name is the model's text too (an unconstrained call names any tool): marked like the rest
        print(
            visible_text(f"[{e.step}/{e.max_steps}] {e.tool} {json.dumps(e.arguments)[:200]}"),
            file=sys.stderr,
        )
    elif isinstance(e, ev.ToolStepDone):
        code = f", exit {e.exit_code}" if e.exit_code is not None else ""
        how = e.decision_words
        print(f"    -> {'ok' if e.ok else 'failed'} ({how}{code}) {e.result[:160]!r}", file=sys.stderr)
    elif isinstance(e, ev.ActionOutput):
        sys.stderr.write(visible_text(e.text))  # command output: untrusted, its escape sequences marked
    elif isinstance(e, ev.StepLimitReached):
        print(f"    stopped: {e.why}" if e.why else f"    step limit reached ({e.steps})", file=sys.stderr)
    elif isinstance(e, ev.Notice):  # its `facts` are said once, in the summary after the answer
        print(visible_text(f"    {e.text}"), file=sys.stderr)


async def run_agent_task(
    session: AgentSession, task: str, echo: bool, record: Callable[[dict[str, Any]], Any] | None = None
) -> dict[str, Any]:
    """`record`: each generation's numbers (its steps' and its answer's), for Stats, as the web app's are."""
    t0 = time.perf_counter()
    answer, finish, stats, error, stalled = "", None, {}, None, ""
    writes: list[dict[str, Any]] = []  # each write's id, for `flashcode changes undo ID`
    async for e in session.run_turn(task):
        if record is not None and isinstance(e, ev.Generated | ev.AnswerDone) and e.stats:
            record(e.stats)
        if isinstance(e, ev.StepLimitReached):
            stalled = e.why
        if isinstance(e, ev.FileWritten):
            writes.append({"id": e.action_id, "path": e.path})
        if echo:
            _progress(e)
            if isinstance(e, ev.AnswerDelta):
                sys.stdout.write(visible_text(e.text))
                sys.stdout.flush()
        if isinstance(e, ev.AnswerDone):  # the last reply is the answer (an empty one: none)
            answer, finish, stats, error = e.text, e.finish_reason, e.stats, e.error
            if echo and e.text and not e.text.endswith("\n"):
                print()  # a later reply (asked for after this one) starts a line of its own
    loop = session.loop
    return {
        "answer": answer,
        "steps": list(loop.records) if loop else [],
        "changed_files": list(dict.fromkeys(loop.written)) if loop else [],
        "writes": writes,  # in order; each can be undone: `flashcode changes undo ID`
        # .py files that parsed before its edits, not after
        "broken_files": dict(loop.broken) if loop else {},
        "stats": {
            "steps": loop.steps if loop else 0,
            "step_limit_reached": bool(loop and loop.steps >= loop.limit),
            "stalled": stalled,  # why it stopped before its limit (a refused call made again and again)
            "time_s": round(time.perf_counter() - t0, 3),
            "finish_reason": finish,
            "error": error,
            "tool_loop": loop is not None,
            "constrained": session.constrained,
            "last_reply": stats,
        },
    }


def approve_mcp_servers(
    store: AgentStore, ref: ProjectRef, hidden: tuple[Path, ...], mode: str
) -> set[tuple[str, str]]:
    """The project's `.mcp.json` servers that are not approved yet, before the task: `ask` asks on
    the terminal (yes: approved for the project, as Settings › MCP servers does), `all` approves
    them for this run only (returned as (name, fingerprint), for `McpTools`), `none` starts none;
    each gets a line on stderr."""
    mstore, run_only = McpStore(store.conn), set()
    network = store.network_allowed(ref.id)
    for cfg in mstore.servers(ref.id, ref.path).servers:
        if cfg.source != "file" or cfg.error or not cfg.enabled or cfg.approved:
            continue
        where, _ = Launch(ref.id, ref.path, cfg, network, hidden).describe_sandbox()
        more = "".join(f"\n  {line}" for line in cfg.details())  # env, headers, variables it reads
        if mode == "none":
            print(
                visible_text(
                    f"MCP server {cfg.name} from .mcp.json is not approved, and --approve none approves "
                    f"nothing: it is not started (it would run `{cfg.describe()}`; approve it with "
                    f"`flashcode tools --project {ref.path} --approve-server {cfg.name}` or Settings › MCP "
                    "servers, or run with --approve ask)"
                ),
                file=sys.stderr,
            )
        elif mode == "all":
            run_only.add((cfg.name, cfg.fingerprint))
            print(
                visible_text(
                    f"MCP server {cfg.name} from .mcp.json approved for this run (--approve all): it runs "
                    f"`{cfg.describe()}` ({where}){more}"
                ),
                file=sys.stderr,
            )
        else:
            print(
                visible_text(
                    f"\nThe project's .mcp.json names the MCP server {cfg.name}, not approved yet. It would run:\n"
                    f"  {cfg.describe()}{more}\n  ({where})\n"
                    "A .mcp.json comes with the project's files: approve it only if you trust this command."
                ),
                file=sys.stderr,
            )
            answer = (
                ask_terminal(visible_text(f"Approve {cfg.name} for this project? [y/N] ")).strip().lower()
            )
            if (
                answer in ("y", "yes") and not sys.stdin.isatty()
            ):  # a pipe answers for this run, saves nothing
                run_only.add((cfg.name, cfg.fingerprint))
                print(visible_text(f"approved {cfg.name} for this run only ({FROM_A_PIPE})"), file=sys.stderr)
            elif answer in ("y", "yes"):
                mstore.approve(ref.id, cfg.name, cfg.fingerprint)
                print(visible_text(f"approved {cfg.name} for {ref.path}"), file=sys.stderr)
            else:
                print(visible_text(f"{cfg.name} is not started"), file=sys.stderr)
    return run_only


def cmd_agent(args: argparse.Namespace) -> int:
    if args.data_dir:
        os.environ[paths.ENV_HOME] = os.path.abspath(os.path.expanduser(args.data_dir))
    if not args.task.strip():
        raise preflight.StartupError("the task is empty: say what the agent should do")
    preflight.check_text(args.task, "the task")
    project = cli_projects.project_dir(
        args
    )  # checked as `ask --project` checks it (a file, a missing folder)
    assert project is not None  # --project is required
    db, projects = cli_projects._store()  # the data dir's database: the same registry as `flashcode projects`
    try:
        ref = projects.add(project)
        store = AgentStore(db.conn)
        hidden = hidden_paths(projects.data_dir)
        run_only = approve_mcp_servers(store, ref, hidden, args.approve)
        model = args.model or DEFAULT_AGENT_MODEL
        if not is_gguf_path(model):  # one that is not installed is said before "loading"
            preflight.check_model(model, paths.home())
        if not args.json:  # loading takes a while: say what is happening
            print(f"loading {model} ({args.backend} backend)…", file=sys.stderr)
        worker = Worker(lambda: engine_host.make_loaded_backend(args.backend, model))
        try:
            backend, loaded = worker.call(lambda b: (b.name, b.model.name if b.model else None))
            session = AgentSession(
                worker,
                ref.path,
                request_approval=terminal_approval(args.approve),
                store=store,
                search=DDGSProvider(),
                project=ref.id,
                hidden=hidden,
                max_steps=args.max_steps,
                constrained=not args.unconstrained,
                # --approve all answers each write's question (said "approved"); only the project's own setting
                # approves edits as a rule (said "allowed by rule")
                approve_edits=args.approve != "none" and store.edits_approved(ref.id),
                sampling=SamplingParams(
                    temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed
                ),
            )

            def counted(stats: dict[str, Any]) -> None:  # in the project's Stats, as its web turns are
                stats_store.record_reply(
                    db.conn, stats, backend=stats.get("backend") or backend, model=stats.get("model") or loaded,
                    source="agent", route="tools", finish_reason=stats.get("finish_reason"), project_id=ref.id,
                )  # fmt: skip

            servers = McpServers()
            session.mcp = servers  # type: ignore[attr-defined]  # stopped when the task is done
            session.mcp_run_approved = run_only  # type: ignore[attr-defined]  # --approve all, this run

            async def main() -> dict[str, Any]:
                try:
                    return await run_agent_task(session, args.task, echo=not args.json, record=counted)
                finally:
                    await servers.close_all()

            result = asyncio.run(main())
        finally:
            worker.close()
    finally:
        db.close()
    result["stats"].update(model=loaded, backend=backend, project=str(project))
    code = _verdict(result)
    if args.json:  # the exit status in the object too, as a failed command's has it (cli.json_error)
        print(json.dumps({**result, "exit_status": code}), flush=True)
        args.json_printed = True
    _undo_hints(result["writes"])  # a run that failed wrote too: then most of all
    return code


def _undo_hints(writes: list[dict[str, Any]]) -> None:
    """One line per write: the command that undoes it, naming the data directory its ids belong to (each
    database numbers its writes from 1) unless it is the default one."""
    home = paths.home()
    data = f" --data-dir {shlex.quote(str(home))}" if home != paths.default_home().resolve() else ""
    for w in writes:
        print(visible_text(f"flashcode: to undo the write of {w['path']}: flashcode changes{data} undo {w['id']}"),
              file=sys.stderr)  # fmt: skip


def _verdict(result: dict[str, Any]) -> int:
    """The exit status of a finished run, with what the tools did said on stderr."""
    st = result["stats"]
    if st["finish_reason"] == "error":
        return 1
    if st["step_limit_reached"]:  # the task was not finished: a script must not take it as done
        why = (
            f"stopped after {st['steps']} steps: {st['stalled']}; say the task another way"
            if st.get("stalled")
            else f"reached the step limit ({st['steps']} steps) before answering; run again with a larger "
            "--max-steps"
            if not result["answer"].strip()
            else f"reached the step limit ({st['steps']} steps): its answer is from what those steps did, and "
            "the task may not be finished; run again with a larger --max-steps"
        )
        print(f"flashcode: the agent {why}", file=sys.stderr)
        return 3
    if not result["answer"].strip():
        # the model ended the task with no words (a small model that gave up): not a success
        print(f"flashcode: the agent ended after {st['steps']} step(s) without an answer", file=sys.stderr)
        return 1
    steps = result["steps"]
    if steps:  # what the tools did, from their records: the answer is the model's words, unchecked
        changed = result["changed_files"]
        ran = sum(1 for r in steps if ran_to_its_end(r))  # with any exit code: each may have changed files
        print(
            (
                visible_text(f"flashcode: files written with the file tools: {', '.join(changed)}")
                if changed
                else "flashcode: no file was written with the file tools"
            )
            + (
                f" ({ran} command{'s' if ran != 1 else ''} ran too, and may have changed others)"
                if ran
                else ""
            ),
            file=sys.stderr,
        )
        for path, why in result["broken_files"].items():
            print(
                visible_text(f"flashcode: {path} does not parse as Python ({why}) after the agent's edits"),
                file=sys.stderr,
            )
        if result["broken_files"]:
            return 4
        # a denial is the user's word, heard; a command that exited with an error returned its output
        if not any(r["ok"] or r["decision"] == "deny" or ran_to_its_end(r) for r in steps):
            print(
                f"flashcode: none of the {len(steps)} steps worked: the answer is not backed by any tool result",
                file=sys.stderr,
            )
            return 4
    return 0


def register_agent(sub: Any) -> None:
    p = sub.add_parser(
        "agent",
        help="run one agent task in a project: the model reads, edits and runs, you approve",
        description="Run one agent task in a project: the model reads, edits and runs, you approve.",
        epilog="exit status: 0 answered; 1 no answer (an engine error, or no words); 2 bad arguments; 3 the step "
        "limit was reached "
        "(its answer, if any, from what the steps did) or the model stalled; 4 an answer, but none of the steps "
        "worked, or a .py file it edited no longer parses. stderr ends with the files written and how to undo "
        "each: flashcode changes undo ID.",
    )
    p.add_argument("task", help="what the agent should do, in one quoted argument")
    p.add_argument("--project", required=True, help="the project directory the agent works in")
    p.add_argument("--model", default=None, help=f"installed model name (default: {DEFAULT_AGENT_MODEL})")
    p.add_argument(
        "--backend", default="auto", choices=["auto", "mlx", "llama", "flash"], help=HELP["backend"]
    )
    p.add_argument(
        "--approve",
        default="ask",
        choices=["ask", "all", "none"],
        help="ask on the terminal (default), approve every edit, command and MCP call (still sandboxed; "
        ".mcp.json servers for this run; never a write into a git directory), or deny all (the project's "
        "allow rules still apply)",
    )
    p.add_argument(
        "--max-steps",
        type=positive_int,
        default=DEFAULT_MAX_STEPS,
        help=f"tool steps before it stops (default {DEFAULT_MAX_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object: answer, steps, stats")
    p.add_argument("--unconstrained", action="store_true", help="no constrained decoding of tool calls")
    agent = default_agent_sampling()  # as an agent conversation in the browser samples
    p.add_argument(
        "--temperature", type=non_negative_float, default=agent["temperature"], help=HELP["temperature"]
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=agent["max_tokens"], help="reply budget of each step"
    )
    p.add_argument("--seed", type=seed, default=None, help=HELP["seed"])
    p.add_argument("--data-dir", default=None, help=HELP["data_dir"])
    p.set_defaults(func=cmd_agent)
