"""Turning values into HTML: the Jinja2 environment every fragment is drawn with, and markdown to
safe HTML for chat messages (markdown-it-py with raw HTML off, pygments for code).

What it knows: where `templates/` and `static/` are; that model output and user text are
untrusted. Templates autoescape everything interpolated. Raw HTML in markdown is never passed
through (markdown-it's `html=False` escapes it), links keep markdown-it's scheme check (no
`javascript:`) and open with `rel=noopener`, and code blocks are highlighted by pygments, which
escapes their contents. `escape_text` shows text verbatim.

What it does not know: which template draws what (each feature's views), websockets, the database.
"""

from __future__ import annotations

import datetime
import hashlib
import html
import re
import secrets
import time
import unicodedata
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markdown_it import MarkdownIt
from markdown_it.common.utils import unescapeAll
from markdown_it.rules_block.table import table as _gfm_table
from markupsafe import Markup
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name, guess_lexer
from pygments.token import Token
from pygments.util import ClassNotFound

from engine import __version__
from engine.models import human_size

PYGMENTS_STYLE = "bw"  # monochrome, as a System 7 screen would be
_FORMATTER = HtmlFormatter(nowrap=True)


def find_dir(name: str) -> Path:
    """`templates/` and `static/` sit at the repo root in a checkout, inside `webapp/` in a wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / name, here / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"flashcode's {name}/ directory is missing (looked next to {here})")


@lru_cache(maxsize=64)
def _digest(path: Path, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def static_url(name: str) -> str:
    """`/static/NAME?v=DIGEST`: the address changes with the file, so a browser never runs a cached app.js of
    an older flashcode against this server (the websocket frames' marks, the fields it sends)."""
    path = find_dir("static") / name
    st = path.stat()
    return f"/static/{name}?v={_digest(path, st.st_mtime_ns, st.st_size)}"


# --------------------------------------------------------------------------- characters that do not show
# Letters and symbols that draw nothing (Hangul fillers, Khmer vowels, Mongolian separator, braille
# blank, combining grapheme joiner); variation selectors draw nothing either.
_BLANK = {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, 0x2800, 0x3164, 0xFFA0}
_CANDIDATE = re.compile(r"[^\t\n\x20-\x7e]")  # ASCII that prints, tab and newline are always fine


def is_invisible(ch: str) -> bool:
    """True for a character a reader cannot see as itself: Cc but tab and newline, every Cf (bidi
    controls U+202A-202E and U+2066-2069, U+200B-200F, U+FEFF, ...), unassigned and private-use
    code points, every space but U+0020, line and paragraph separators, and blank letters."""
    if ch in "\t\n":
        return False
    cat, code = unicodedata.category(ch), ord(ch)
    return (
        cat[0] == "C"
        or (cat[0] == "Z" and ch != " ")
        or code in _BLANK
        or 0xFE00 <= code <= 0xFE0F
        or 0x180B <= code <= 0x180F
        or 0xE0100 <= code <= 0xE01EF
    )


def marker(ch: str) -> str:
    return f"<U+{ord(ch):04X}>"


def visible_text(text: str) -> str:
    """`text` for a terminal: each character a reader cannot see as itself — control characters (a terminal's
    escape sequences, carriage return, backspace), bidi controls, zero-width ones — as a `<U+…>` marker; tab
    and newline kept. Untrusted text (a proposed command, a diff, command output, a `.mcp.json`) could
    otherwise redraw the approval prompt it is printed in."""
    return _CANDIDATE.sub(lambda m: marker(m.group()) if is_invisible(m.group()) else m.group(), text)


def visible_line(value: Any) -> str:
    """`value` as text on one line, for a line of an approval prompt or dialog: `visible_text`, and tab
    and newline as markers too (a config value must not start a line of its own under the prompt)."""
    return visible_text(str(value)).replace("\t", marker("\t")).replace("\n", marker("\n"))


def hidden_chars(text: str) -> list[str]:
    """The characters of `text` a reader cannot see, in order (repeats kept)."""
    return [m.group() for m in _CANDIDATE.finditer(text) if is_invisible(m.group())]


def invisible_parts(text: str | None) -> list[tuple[bool, str]]:
    """`text` cut for a template: (False, visible run) and (True, "<U+202E>") for each hidden
    character, in order. The Jinja filter `invisible_parts`."""
    text = "" if text is None else str(text)
    out: list[tuple[bool, str]] = []
    start = 0
    for m in _CANDIDATE.finditer(text):
        if not is_invisible(m.group()):
            continue
        if m.start() > start:
            out.append((False, text[start : m.start()]))
        out.append((True, marker(m.group())))
        start = m.end()
    if start < len(text) or not out:
        out.append((False, text[start:]))
    return out


_TITLE_NOTE = re.compile(r"^(.*\S)( \([^()]{1,24}\))$")


def title_tail(title: str) -> tuple[str, str]:
    """A list row's title cut where a narrow window must keep its end: "Plan (imported 2)" is ("Plan",
    " (imported 2)"), and the row shortens the first part only ("Pl… (imported 2)"), as the Finder shortens a
    long name in its middle. Rows told apart by that note alone were all "Plan (impo…". ("title", "") for a
    title that ends in no such note. The Jinja filter `title_tail`."""
    found = _TITLE_NOTE.match(title)
    return (found.group(1), found.group(2)) if found else (title, "")


def make_environment() -> Environment:
    """The one template environment of an app: autoescaping on for every .html template."""
    env = Environment(loader=FileSystemLoader(find_dir("templates")), autoescape=select_autoescape(["html"]))
    env.filters["markdown"] = markdown_markup
    env.filters["human_size"] = human_size
    env.filters["invisible_parts"] = invisible_parts  # untrusted names: their hidden characters shown
    env.filters["visible_line"] = visible_line  # the same as plain text on one line (a tooltip)
    env.filters["when"] = when
    env.filters["title_tail"] = title_tail  # a list row's title, its "(imported 2)" kept in sight
    env.filters["list_when"] = list_when  # a list's date column: "09:14", "Yesterday", "Mon", "3 Dec"
    env.filters["web_url"] = web_url  # an untrusted link: http(s) only
    env.globals["flashcode_version"] = __version__  # About flashcode
    env.globals["static_url"] = static_url  # our own scripts and styles, by content (vendored: by name)
    env.globals["page_mark"] = lambda: secrets.token_hex(8)  # a chat window's own mark (`draft_field`)
    return env


def when(epoch: float | None) -> str:
    """A moment as this computer's local date and time to the minute ("" for none)."""
    if not isinstance(epoch, int | float):  # None, or a value a template did not have
        return ""
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(epoch))


def list_when(epoch: float | None, now: float | None = None) -> str:
    """A moment for a list's date column, as the Finder's: the time if today, "Yesterday", the weekday
    within the week, the day and month this year, else with the year (this computer's local time)."""
    if not isinstance(epoch, int | float):
        return ""
    t, n = time.localtime(epoch), time.localtime(time.time() if now is None else now)
    days = (
        datetime.date(n.tm_year, n.tm_mon, n.tm_mday) - datetime.date(t.tm_year, t.tm_mon, t.tm_mday)
    ).days
    if days == 0:
        return time.strftime("%H:%M", t)
    if days == 1:
        return "Yesterday"
    if 1 < days < 7:
        return time.strftime("%a", t)
    if days > 0 and t.tm_year == n.tm_year:
        return f"{t.tm_mday} {time.strftime('%b', t)}"
    return f"{t.tm_mday} {time.strftime('%b', t)} {t.tm_year}"


def escape_text(text: str) -> str:
    return html.escape(text, quote=False)


def _highlight(code: str, lang: str, _attrs: str) -> str:
    lexer = None
    name = (lang or "").strip().split()[0] if lang and lang.strip() else ""
    if name:
        try:
            lexer = get_lexer_by_name(name)
        except ClassNotFound:
            lexer = None
    if lexer is None:
        if len(code) < 20:
            return ""  # markdown-it escapes it itself
        try:
            lexer = guess_lexer(code)
        except ClassNotFound:
            return ""
        # a wrong guess marks what it cannot read as errors (a Python `#` boxed in red as JavaScript): plain then
        if any(kind in Token.Error for kind, _ in lexer.get_tokens(code)):
            return ""
    return highlight(code, lexer, _FORMATTER)


@lru_cache(maxsize=1)
def _md() -> MarkdownIt:
    # breaks: a model's single newline is a line break, as in every chat app (a listing of files, one a
    # line, was one paragraph); a blank line still ends a paragraph.
    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False, "breaks": True})
    md.enable("table")
    md.block.ruler.at("table", _bounded_table, {"alt": ["paragraph", "reference"]})
    md.enable("strikethrough")

    def link_open(renderer, tokens, idx, options, env):  # type: ignore[no-untyped-def]
        tokens[idx].attrSet("rel", "noopener noreferrer")
        tokens[idx].attrSet("target", "_blank")
        return renderer.renderToken(tokens, idx, options, env)

    md.add_render_rule("link_open", link_open)
    md.add_render_rule("fence", _fence)
    md.add_render_rule("code_block", _code_block)
    return md


@lru_cache(maxsize=1)
def _code_macros() -> Any:
    return make_environment().get_template("markdown.html").module


# A table's cells in one message, at most: markdown-it fills every row out to the header's width (a 1.5 KB
# table of 256 columns becomes 65,000 cells and 0.7 MB of HTML, ~1.5 s here), so untrusted text could
# stall the server. A table that would pass the budget is shown as the text it is.
MAX_TABLE_CELLS = 10_000


def _bounded_table(state: Any, start: int, end: int, silent: bool) -> bool:
    """markdown-it's table rule, under MAX_TABLE_CELLS for the whole text (`state.env` counts them): the
    header's width times the rows up to the next blank line, counted before the table is built."""
    if start + 2 > end:
        return False
    delimiter = state.src[state.bMarks[start + 1] + state.tShift[start + 1] : state.eMarks[start + 1]]
    width = len(delimiter.strip().strip("|").split("|"))
    rows, line = 0, start + 2  # the header, then each line up to a blank one (the delimiter line is none)
    while line < end and state.bMarks[line] + state.tShift[line] < state.eMarks[line]:
        rows, line = rows + 1, line + 1
    rows += 1
    used = int(state.env.get("table_cells", 0))
    if used + width * rows > MAX_TABLE_CELLS:
        return False
    found = bool(_gfm_table(state, start, end, silent))
    if found and not silent:
        state.env["table_cells"] = used + width * rows
    return found


def _fence(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    """A fenced block, highlighted when its language (or a guess) is known (`templates/markdown.html`)."""
    token = tokens[idx]
    info = unescapeAll(token.info).strip() if token.info else ""
    lang = info.split(maxsplit=1)[0] if info else ""
    highlighted = _highlight(token.content, lang, "")
    return str(_code_macros().code_block(token.content, lang, Markup(highlighted) if highlighted else None))


def _code_block(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    """An indented block: shown as it is."""
    return str(_code_macros().code_block(tokens[idx].content))


def web_url(url: object) -> str | None:
    """An untrusted address (a search result, an imported one) as a link target: http and https only, else
    None (the template shows it as text). A `javascript:` or `data:` link would otherwise be stopped only
    by the CSP."""
    text = str(url or "").strip()
    scheme = text.split(":", 1)[0].lower() if ":" in text else ""
    return text if scheme in ("http", "https") and not any(c in text for c in "\x00\n\r\t") else None


def render_markdown(text: str) -> str:
    """Untrusted markdown -> HTML safe to insert into the page."""
    return _md().render(text, {})  # env: this text's own table budget


def markdown_markup(text: str) -> Markup:
    """`render_markdown` as markup a template may insert (the `markdown` filter)."""
    return Markup(render_markdown(text))  # noqa: S704 - rendered with raw HTML off, see the module doc


def pygments_css() -> str:
    return HtmlFormatter(style=PYGMENTS_STYLE).get_style_defs(".highlight")
