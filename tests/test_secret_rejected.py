"""A line gin rejects never shows a secret: the error's problem, where, statement and fix, through the Python API
(``instrument.parse_config``) as through the CLI. Each case is one a review found printed in clear."""

import pytest

import instrument
from instrument.config import GinConfigError, clear_config
from instrument.logger.params import REDACTED


def _error(tmp_path, text: str, bindings=()) -> str:
    """The message of the error parsing ``text`` (a .gin file) and ``bindings`` raises."""
    (tmp_path / "bad.gin").write_text("import instrument\n" + text)
    clear_config()
    with pytest.raises(GinConfigError) as info:
        instrument.parse_config([str(tmp_path / "bad.gin")], list(bindings))
    error = info.value
    return "\n".join([str(error), error.problem, error.where, error.statement, error.fix])


@pytest.mark.parametrize("key", ['"api_key\'"', "'api' '_key'", '"api_key\\""', "'api'\n   '_key'", "'''api_key'''",
                                 "'api\\x5fkey'"])
def test_a_dict_key_with_a_quote_or_of_adjacent_literals_is_seen_as_secret(tmp_path, key):
    """A review found a key holding the other quote, an escape, or spelt by two adjacent string literals (which
    Python joins) not seen as secret on a line gin rejects: the value printed in clear."""
    message = _error(tmp_path, f"Instrumentation.tags = {{{key}: 'KEYLEAK21' oops}}\n")
    assert "KEYLEAK21" not in message and REDACTED in message, message
