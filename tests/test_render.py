"""Markdown rendering: highlighted code, and untrusted text never becoming markup."""

from __future__ import annotations

import time

from webapp.render import escape_text, list_when, pygments_css, render_markdown


def test_render_escapes_html_in_model_output() -> None:
    out = render_markdown("hi <script>alert(1)</script>\n\n<img src=x onerror=alert(1)>")
    assert "<script" not in out and "<img" not in out
    assert "&lt;script&gt;" in out and "&lt;img src=x onerror=alert(1)&gt;" in out


def test_render_refuses_javascript_links_and_marks_links_noopener() -> None:
    out = render_markdown("[x](javascript:alert(1)) [y](https://example.org)")
    assert 'href="javascript' not in out
    assert 'href="https://example.org" rel="noopener noreferrer"' in out


def test_render_highlights_code_and_escapes_it() -> None:
    out = render_markdown('```python\ndef f():\n    return "<b>"\n```')
    assert '<pre class="highlight">' in out and '<span class="k">def</span>' in out
    assert "&lt;b&gt;" in out and "<b>" not in out


def test_render_plain_code_and_inline() -> None:
    out = render_markdown("use `a<b` here\n\n```\nx < y\n```")
    assert "<code>a&lt;b</code>" in out and "x &lt; y" in out


def test_a_guessed_language_that_cannot_read_the_code_leaves_it_plain() -> None:
    """A fence with no language gets pygments' guess; a small model's Python (opened with a bare fence) was
    guessed as another language whose lexer boxed each `#` in red as an error. Such a guess is dropped."""
    fence = (
        "```\n\nRewrite code using recursion:\n\n# A simple example of a recursive function in Python.\n"
        "def factorial(n):\n    if n == 0:\n        return 1\n    else:\n        return n * factorial(n - 1)\n\n"
        "# Output: Factorial of 1 = 1\nprint(factorial(1))\n\n# Output: Factorial of 2 = 2\nprint(factorial(2))\n```"
    )
    out = render_markdown(fence)
    assert 'class="err"' not in out and "# Output: Factorial of 1 = 1" in out
    assert '<span class="k">def</span>' in render_markdown(
        "```python\ndef f(): pass  # ok\n```"
    )  # named: highlighted


def test_render_helpers() -> None:
    assert escape_text("<&>") == "&lt;&amp;&gt;"
    assert ".highlight" in pygments_css()


def test_render_keeps_a_models_single_newlines_as_line_breaks() -> None:
    # A listing one file a line (or a numbered one not starting at 1) was joined into one paragraph.
    out = render_markdown("The files:\nsrc/a.py\n2. src/b.py\n\nNext paragraph")
    assert out.count("<br />") == 2 and out.count("<p>") == 2
    assert "src/a.py<br />" in out


def test_list_when_reads_as_a_finder_date_column() -> None:
    now = time.mktime((2026, 12, 6, 15, 30, 0, 0, 0, -1))  # a Sunday afternoon, local time

    def at(*ymdhm: int) -> float:
        return time.mktime((*ymdhm, 0, 0, 0, -1))

    assert list_when(at(2026, 12, 6, 9, 5), now) == "09:05"
    assert list_when(at(2026, 12, 5, 23, 59), now) == "Yesterday"
    assert list_when(at(2026, 12, 1, 8, 0), now) == "Tue"
    assert list_when(at(2026, 11, 30, 8, 0), now) == "Mon"  # six days back
    assert list_when(at(2026, 11, 29, 8, 0), now) == "29 Nov"
    assert list_when(at(2025, 12, 30, 8, 0), now) == "30 Dec 2025"
    assert list_when(at(2026, 12, 9, 8, 0), now) == "9 Dec 2026"  # a clock set back: a date, not "Wed"
    assert list_when(None, now) == ""
