"""The agent's fragments: the approval alert shows what the issue asks, escapes everything, and
every event the websocket forwards renders."""

from __future__ import annotations

import re

import pytest
from jinja2 import Environment, FileSystemLoader, select_autoescape

from webapp.agent import events as ev
from webapp.agent.search import SearchResult
from webapp.agent.shell import check_command
from webapp.agent.views import AgentViews
from webapp.render import find_dir


@pytest.fixture(scope="module")
def views() -> AgentViews:
    return AgentViews(
        Environment(loader=FileSystemLoader(find_dir("templates")), autoescape=select_autoescape(["html"]))
    )


def proposal(command: str, **kw: object) -> ev.Proposal:
    v = check_command(command, [])
    fields = dict(
        action_id=7,
        tool="shell",
        command=v.command,
        cwd="/home/me/proj",
        timeout_s=30.0,
        rule_text=v.reason,
        prefix=v.prefix,
        prefix_blocked=v.prefix_blocked,
        choices=("deny", "once", "always_exact", "always_prefix")
        if v.prefix
        else ("deny", "once", "always_exact"),
    )
    fields.update(kw)
    return ev.Proposal(**fields)  # type: ignore[arg-type]


def test_approval_dialog_shows_command_cwd_timeout_rule_and_buttons(views: AgentViews) -> None:
    html = views.approval_dialog(proposal("git status --short"), "d1")
    assert 'id="alerts" hx-swap-oob="beforeend"' in html and 'id="dialog-d1"' in html
    assert "git status --short" in html and "/home/me/proj" in html and "30 s" in html
    assert "no allow rule matches" in html
    buttons = re.findall(r'data-choice="(\w+)"', html)
    assert buttons == ["deny", "once", "always_exact", "always_prefix"]
    assert re.search(r'class="btn btn-default" data-choice="deny" autofocus', html)
    assert (
        'class="approval-form"' in html
        and "hx-on" not in html
        and 'name="note"' in html
        and 'name="dialog_id" value="d1"' in html
    )
    assert "<code>git status</code>" in html and "Always allow this exact command in this project" in html


def test_approval_dialog_says_who_asked_for_the_command(views: AgentViews) -> None:
    assert "The agent wants to run this command" in views.approval_dialog(proposal("ls"), "d1")
    typed = views.approval_dialog(proposal("ls", typed=True), "d1")
    assert "You asked to run this command (/shell)" in typed and "The agent wants" not in typed


def test_approval_dialog_disables_prefix_for_wrappers_and_escapes(views: AgentViews) -> None:
    html = views.approval_dialog(proposal("sh -c '<script>alert(1)</script>'"), "d2")
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert re.search(r'data-choice="always_prefix"[^>]*disabled title="`sh` is not in flashcode', html)


def test_search_cards_show_title_site_snippet_link(views: AgentViews) -> None:
    r = SearchResult("Title <b>x</b>", "https://www.example.com/a?b=1", "snippet & more")
    html = views.event(ev.SearchResults("q", (r.to_dict(),)))
    assert "[1]" in html and "example.com" in html and "snippet &amp; more" in html and "&lt;b&gt;" in html
    assert 'href="https://www.example.com/a?b=1"' in html and 'rel="noopener noreferrer"' in html


def test_every_forwarded_event_renders(views: AgentViews) -> None:
    samples = [
        ev.RouteChosen(
            "shell", {"chat": -3.0, "search": -2.0, "shell": -1.0}, {"chat": 0.1, "search": 0.2, "shell": 0.7}
        ),
        ev.SearchStarted("q", "text", "local"),
        ev.SearchUnavailable("web search is unavailable: offline"),
        proposal("ls"),
        ev.Decided(7, "once"),
        ev.Decided(7, "deny", reason="no <thanks>"),
        ev.ActionOutput(7, "stdout", "<out>"),
        ev.ActionExit(7, 0, False, False, False, 0.1, "exit code 0"),
        ev.FileShown("a.py", "x"),
        ev.FileWritten(8, "a.py"),
        ev.HelpShown("/help"),
        ev.Notice("hi"),
        ev.ModeChanged("raw"),
        ev.ModeChanged("agent", "<m> does not take tools"),
        ev.Cleared(),
        ev.ModelRequested("m"),
        ev.SlashUnhandled("stats", ""),
    ]
    for e in samples:
        html = views.event(e)
        assert html.strip() and "hx-swap-oob" in html, e
        assert "<out>" not in html and "<thanks>" not in html
    assert views.event(ev.AnswerDelta("x")) == "" and views.event(ev.TurnDone("chat")) == ""


@pytest.mark.parametrize("tool", ["shell", "write", "mcp"])
def test_every_swap_after_a_proposal_finds_its_target(views: AgentViews, tool: str) -> None:
    """The decision, output and end of an action are swapped into its block by id: each id they target is in
    the block the proposal drew, whatever the tool (a write's "Wrote a.py" or "Not run" had no target:
    htmx's oobErrorNoTarget, and the line was lost)."""
    block = views.event(proposal("ls", tool=tool))
    later = [ev.Decided(7, "deny", reason="no"), ev.Decided(7, "once"), ev.FileWritten(7, "a.py")]
    if tool == "shell":
        later += [
            ev.ActionOutput(7, "stdout", "x"),
            ev.ActionExit(7, 0, False, False, False, 0.1, "exit code 0"),
        ]
    ids = set(re.findall(r'\bid="([\w-]+)"', block))
    for e in later:
        for target in re.findall(
            r'<\w+[^>]*\bid="([\w-]+)"[^>]*hx-swap-oob="(?:true|beforeend)"', views.event(e)
        ):
            assert target in ids, (tool, e, target)


def test_a_commands_stop_button_waits_for_its_approval(views: AgentViews) -> None:
    """ "Stop command" is greyed while the command waits for approval (nothing runs yet: it read as if something
    did), enabled once it is approved, and at once for a command a rule allows."""
    stop = re.compile(r"<button[^>]*>Stop command</button>")
    (waiting,) = stop.findall(views.event(proposal("ls")))
    assert " disabled" in waiting and "until you approve" in waiting
    (ruled,) = stop.findall(views.event(proposal("ls", allowed_by_rule=True)))
    assert " disabled" not in ruled
    approved = views.event(ev.Decided(7, "once", tool="shell"))
    (enabled,) = stop.findall(approved)
    assert " disabled" not in enabled and 'id="action-7-exit" hx-swap-oob="true"' in approved
    assert not stop.findall(views.event(ev.Decided(7, "once", tool="write")))
    assert "Not run" in views.event(ev.Decided(7, "deny", tool="shell"))
