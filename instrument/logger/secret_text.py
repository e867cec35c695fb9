"""Which words of a secret value's text are the secret: its ``#`` comments and the names it refers to are not.

A value gin rejects under a secret name is left out whole, and each word of it is also hunted for in the rest of
the error message (gin may quote a token of it). A comment's words, or a configurable's or macro's name
(``@train_nca``, ``%TOK``), taken for the secret's, blanked the same ordinary words everywhere in that message
(``fix: <redacted> it for a string``).
"""

import re
from typing import List

__all__ = ["secret_words", "uncommented"]

_REFERENCE = re.compile(r"[@%][\w./]*(?:\(\))?")


def uncommented(text: str, references: bool = True) -> str:
    """``text`` without its ``#`` comments (each to its line's end), strings read as Python reads them (escapes,
    triple quotes; a one-line string never closed ends with its line, and a ``#`` in it is kept, as a secret's
    text may hold one); with ``references=False``, without the references and macros outside strings too."""
    out, i, quote = [], 0, ""
    while i < len(text):
        ch, start = text[i], i
        if quote:
            if ch == "\\":
                i += 2
            elif text.startswith(quote, i):
                i, quote = i + len(quote), ""
            else:
                quote = "" if ch == "\n" and len(quote) == 1 else quote
                i += 1
        elif ch in "'\"":
            quote = text[i:i + 3] if text[i:i + 3] == ch * 3 else ch
            i += len(quote)
        elif ch == "#":
            newline = text.find("\n", i)
            i = len(text) if newline < 0 else newline
            continue
        elif ch in "@%" and not references:
            i = _REFERENCE.match(text, i).end()  # type: ignore[union-attr]  (it matches the '@' at least)
            out.append(" ")
            continue
        else:
            i += 1
        out.append(text[start:i])
    return "".join(out)


def secret_words(value: str) -> List[str]:
    """The words (4 characters or more) of a secret value's text to scrub from other text: not its comments,
    references or macros, nor True, False and None."""
    text = uncommented(value, references=False)
    # gin's token ends at a '-' (an unquoted ``hf_abcd-efgh`` is quoted back as 'hf_abcd'): the parts too
    words = re.findall(r"[\w-]{4,}", text) + [w for w in re.findall(r"\w{4,}", text)]
    return [w for w in dict.fromkeys(words) if w not in ("True", "False", "None")]
