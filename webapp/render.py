"""Markdown to safe HTML for chat messages: markdown-it-py (raw HTML off) + pygments for code.

What it knows: that model output and user text are untrusted. Raw HTML in the source is never
passed through (markdown-it's `html=False` escapes it), links keep markdown-it's scheme check
(no `javascript:`) and open with `rel=noopener`, and code blocks are highlighted by pygments, which
escapes their contents. `escape_text` is for the streaming path, where text is shown verbatim
until the final re-render.

What it does not know: templates, websockets, the database.
"""

from __future__ import annotations

import html
from functools import lru_cache

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound

PYGMENTS_STYLE = "bw"  # monochrome, as a System 7 screen would be
_FORMATTER = HtmlFormatter(nowrap=True)


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
    return highlight(code, lexer, _FORMATTER)


@lru_cache(maxsize=1)
def _md() -> MarkdownIt:
    md = MarkdownIt(
        "commonmark", {"html": False, "linkify": False, "typographer": False, "highlight": _highlight}
    )
    md.enable("table")
    md.enable("strikethrough")

    def link_open(renderer, tokens, idx, options, env):  # type: ignore[no-untyped-def]
        tokens[idx].attrSet("rel", "noopener noreferrer")
        tokens[idx].attrSet("target", "_blank")
        return renderer.renderToken(tokens, idx, options, env)

    md.add_render_rule("link_open", link_open)
    return md


def render_markdown(text: str) -> str:
    """Untrusted markdown -> HTML safe to insert into the page."""
    out = _md().render(text)
    # highlighted fences come back as <pre><code class="language-x">...; mark them for the stylesheet
    return out.replace("<pre><code", '<pre class="highlight"><code')


def pygments_css() -> str:
    return HtmlFormatter(style=PYGMENTS_STYLE).get_style_defs(".highlight")
