"""Data quoted for the model: nothing inside can open or close the `<untrusted>` block.

What it knows: how a reader might still see a tag where there is none on the surface: any case,
spaces, tabs, slashes or NULs between `<` and the word, zero-width, bidi or combining characters
inside the word, full-width and lookalike brackets and letters (`＜／ｕｎｔｒｕｓｔｅｄ＞`,
Cyrillic `е`, `‹`). It reads the text as such a reader would (NFKC, case folded, lookalikes mapped,
everything but letters, digits and `<` dropped) and escapes each `<` that starts `untrusted` there
(it becomes `&lt;`). Control characters become visible control pictures (NUL is `␀`), so no C
string ends early and cuts the closing tag off. What it does not know: prompts, the agent loop.
"""

from __future__ import annotations

import re
import unicodedata

TAG = "untrusted"
# What a reader may take for "<", and for the letters of "untrusted" (after NFKC and casefold).
_OPEN = "<‹〈⟨˂ᐸ❮❬⧼«≺⊲⟪《⦑"
_LOOKALIKES = str.maketrans(
    {
        **dict.fromkeys(_OPEN, "<"),
        "υ": "u",
        "ս": "u",
        "ᴜ": "u",
        "ʊ": "u",
        "ո": "n",
        "ɴ": "n",
        "η": "n",
        "п": "n",
        "т": "t",
        "ᴛ": "t",
        "τ": "t",
        "г": "r",
        "ʀ": "r",
        "ᴦ": "r",
        "ѕ": "s",
        "ꜱ": "s",
        "ʂ": "s",
        "е": "e",
        "ҽ": "e",
        "ᴇ": "e",
        "ε": "e",
        "є": "e",
        "ԁ": "d",
        "ᴅ": "d",
        "ɗ": "d",
    }
)
_TAG_START = re.compile("<" + TAG)


def fold(ch: str) -> str:
    """What a reader may take `ch` for: "<", lowercase letters and digits, or "" (drawn as nothing,
    or punctuation and space that a tag may have between `<` and its name)."""
    text = unicodedata.normalize("NFKC", ch).casefold().translate(_LOOKALIKES)
    return "".join(c for c in text if c == "<" or c.isalnum())


def _tag_starts(text: str) -> set[int]:
    """Indices (in `text`) of the characters that read as the `<` of an `untrusted` tag."""
    folded: list[str] = []
    origin: list[int] = []
    for i, ch in enumerate(text):
        for c in fold(ch):
            folded.append(c)
            origin.append(i)
    return {origin[m.start()] for m in _TAG_START.finditer("".join(folded))}


def _picture(ch: str) -> str:
    code = ord(ch)
    if ch in "\t\n\r" or (0x20 <= code < 0x7F) or code > 0x7F:
        return ch
    return chr(0x2421) if code == 0x7F else chr(0x2400 + code)  # ␀ ␁ … ␟, ␡


# A chat template's control tokens, as a model's tokenizer reads them from text: `<|im_end|>` (ChatML),
# `<|eot_id|>` (Llama 3), `<|end|>` (Phi), `<｜end▁of▁sentence｜>` (DeepSeek), `<end_of_turn>` (Gemma),
# `</s>` and `[INST]` (Llama 2, Mistral),
# Qwen's `<tool_call>` and `<think>`. Quoted data holding one could end its turn and forge a system or
# user turn (llama-server tokenizes a rendered prompt with special tokens parsed; so do Hugging Face
# tokenizers): each is broken, its "<" escaped or its bracket drawn as a look-alike.
_CONTROL_TOKENS = re.compile(
    r"<(?=[|｜])|<(?=/?(?:tool_call|tool_response|think|start_of_turn|end_of_turn|s|eos|bos|pad|unk)>)"
    r"|\[(?=/?[A-Z][A-Z_]{2,30}\])",  # Mistral's [INST], [SYSTEM_PROMPT], [TOOL_CONTENT]; Llama 2's [/INST]
)  # `<|…|>` and DeepSeek's full-width `<｜…｜>` by their opening


def neutralise(text: str) -> str:
    """`text` with every tag-like `<untrusted` escaped, a chat template's control tokens broken, and C0
    controls drawn as control pictures."""
    starts = _tag_starts(text) | {m.start() for m in _CONTROL_TOKENS.finditer(text) if text[m.start()] == "<"}
    brackets = {m.start() for m in _CONTROL_TOKENS.finditer(text) if text[m.start()] == "["}
    return "".join(
        "&lt;" if i in starts else "［" if i in brackets else _picture(ch) for i, ch in enumerate(text)
    )


def attribute(value: str, limit: int = 200) -> str:
    """`value` as the quoted attribute of the opening tag: one line, no quote and no bracket of any
    kind (so it cannot join the text after it into a tag either)."""
    one_line = " ".join("".join(" " if unicodedata.category(c)[0] in "CZ" else c for c in value).split())
    out = []
    for ch in one_line[:limit]:
        if "<" in fold(ch):
            out.append("&lt;")
        else:
            out.append({'"': "&quot;", ">": "&gt;"}.get(ch, ch))
    return "".join(out)


# what a model copies of the quoting into its own words: the tags, and the escape of a `<` inside (the 0.5B model
# ended an answer with "return a * b </untrusted>", shown to the user as it stood)
_WRAPPER = re.compile(r'\s*</?untrusted(?:\s+source="[^"\n]*")?\s*>\s*', re.IGNORECASE)


def without_wrapper(text: str) -> str:
    """A model's answer without the `<untrusted>` tags it copied from the quoted results."""
    if not _WRAPPER.search(text):
        return text
    return _WRAPPER.sub(lambda m: "\n" if "\n" in m.group(0) else " ", text).strip()
