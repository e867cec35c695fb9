"""A line gin rejects never shows a secret: the error's problem, where, statement and fix, through the Python API
(``instrument.parse_config``) as through the CLI. Each case is one a review found printed in clear."""

import pytest

import instrument
from instrument.config import GinConfigError, clear_config
from instrument.logger.params import REDACTED
from instrument.logger.secret_text import secret_words


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


@pytest.mark.parametrize("comment", ["# quote it for a string", "# was 'quote it' for a string"])
@pytest.mark.parametrize("value", ["tags = {{'password': ['abc',  {}\n   CMTLEAK31]}}",
                                   "api_key = ('abc',  {}\n   CMTLEAK31)"])
def test_the_words_of_a_comment_inside_a_secret_value_blank_nothing_else(tmp_path, comment, value):
    """A review found a comment's words inside a secret value taken for the secret's: the same ordinary words of
    the message were blanked (``fix: <redacted> it for a string``)."""
    message = _error(tmp_path, f"Instrumentation.{value.format(comment)}\n")
    assert "CMTLEAK31" not in message and REDACTED in message, message
    assert "fix: quote it for a string" in message, message


def test_a_reference_inside_a_secret_value_is_no_secret_word(tmp_path):
    """A review found ``@train_nca`` inside a container under a secret key blanked everywhere in the message (the
    fix's ``this parameter takes e.g. train_nca.env = ...`` too): a configurable's name is no part of the secret."""
    message = _error(tmp_path, "Instrumentation.tags = {'password': [@Instrumentation, REFLEAK41 oops]}\n")
    assert "REFLEAK41" not in message and REDACTED in message, message
    assert "e.g. Instrumentation.tags = " in message, message
    assert secret_words("[@train_nca(), %TOK, 'x#y' REFLEAK41  # note it\n]") == ["REFLEAK41"]


@pytest.mark.parametrize("comment", ["# old \\", "# it's old \\", "# see 'x' \\"])
def test_a_comment_ending_in_a_backslash_inside_the_secret_keys_list_hides_no_key(tmp_path, comment):
    """A review found the pre-scan joining a comment that ends in a backslash with the next line, as if it went on
    (it continues nothing, in gin as in Python): the keys on that line were never read, so an error before gin
    read the list printed their values."""
    from instrument.config import located

    text = (f"Instrumentation.tags = {{'mycred': 'BSLEAK51' oops}}\n"
            f"Instrumentation.secret_keys = ['foo',  {comment}\n    'mycred']\n")
    message = _error(tmp_path, text)
    assert "BSLEAK51" not in message and REDACTED in message, message
    assert located.declared_secret_keys([str(tmp_path / "bad.gin")], []) == ["foo", "mycred"]


@pytest.mark.parametrize("value", ["Instrumentation.api_key = ['INCLEAK61',",
                                   "Instrumentation.tags = {'password': ('INCLEAK61',"])
@pytest.mark.parametrize("line, word", [("include 'other.gin'", "include"), ("import instrument  # again", "import")])
def test_an_include_line_after_an_unclosed_secret_value_is_named(tmp_path, value, line, word):
    """A review found an unclosed secret list followed by an ``include`` line saying gin stopped at
    '<redacted>': the include line was read as part of the secret value, though it is a statement of its own."""
    message = _error(tmp_path, f"{value}\n{line}\n")
    assert "INCLEAK61" not in message and REDACTED in message, message
    assert f"gin stopped at line 3: it cannot read '{word}' there" in message, message


@pytest.mark.parametrize("use", [
    "Instrumentation.hyperparams = {'api_key': %TOK}",
    "Instrumentation.hyperparams = {'password': [%INNER]}\nINNER = %TOK",  # in a container, a macro of a macro
    "Instrumentation.secret_keys = ['mycred']\nInstrumentation.hyperparams = {'mycred': %TOK}",  # the run's own
    "Instrumentation.secret_keys = ['run_name']\nInstrumentation.run_name = %TOK",
])
@pytest.mark.parametrize("in_file", [True, False])
def test_a_macro_rejected_before_the_line_that_makes_it_secret_leaves_its_value_out(tmp_path, use, in_file):
    """A review found ``TOK = 'hunter2' oops`` printed in clear when gin rejected it before reading the line that
    uses it under a secret name (``Sink.api_key = %TOK``, later in the file, or the file when TOK is a --bind)."""
    macro = "TOK = 'MACLEAK71' oops"
    message = _error(tmp_path, f"{macro}\n{use}\n" if in_file else f"{use}\n", [] if in_file else [macro])
    assert ("bad.gin, line 2" if in_file else "--bind") in message, message
    assert "MACLEAK71" not in message and REDACTED in message, message
    plain = "LR = 0.5 oops\nInstrumentation.hyperparams = {'password': %TOK, 'lr': %LR}\n"
    assert "LR = 0.5 oops" in _error(tmp_path, plain)  # a macro used beside a secret, not under it


@pytest.mark.parametrize("binding", ["Instrumentation.api_key = APILEAK81 oops", "Instrumentation.api_key = 'APILEAK81",
                                     "Instrumentation.hyperparams = {'password': APILEAK81}"])
def test_the_python_api_leaves_a_rejected_binding_out_as_the_cli_does(tmp_path, binding):
    """A review found ``parse_config(files, bindings)`` naming a rejected binding in clear in the error's
    ``where`` (``--bind 'X.api_key = ...'``), which the CLI redacts: both now show the same."""
    clear_config()
    with pytest.raises(GinConfigError) as info:
        instrument.parse_config([], [binding])
    error = info.value
    for text in (str(error), error.problem, error.where, error.statement, error.fix, *error.args):
        assert "APILEAK81" not in text, text
    assert error.where.startswith("--bind ") and REDACTED in error.where, error.where
    with pytest.raises(instrument.ConfigurationError) as info:
        instrument.parse_config([], binding)  # a string, not a list: echoed, redacted
    assert "APILEAK81" not in str(info.value) and REDACTED in str(info.value), info.value


def test_the_macro_prescan_reads_a_text_that_binds_nothing(tmp_path):
    from instrument.config import located

    (tmp_path / "empty.gin").write_text("# nothing bound\nimport instrument\n")
    assert located.declared_secrets([str(tmp_path / "empty.gin")], []) == ([], [])


def test_an_uncaught_error_s_traceback_leaves_the_secret_out_of_its_cause_too(tmp_path):
    """A review found the redacted error raised ``from`` gin's own exception, whose text quotes the rejected line:
    a script that does not catch it printed the secret in the traceback's cause."""
    import traceback

    (tmp_path / "bad.gin").write_text("import instrument\nWandbBackend.api_key = 'CAUSELEAK41' oops\n")
    for files, bindings in (([str(tmp_path / "bad.gin")], []), ([], ["WandbBackend.api_key = 'CAUSELEAK41' x"])):
        clear_config()
        with pytest.raises(GinConfigError) as info:
            instrument.parse_config(files, bindings)
        shown = "".join(traceback.format_exception(info.value))
        assert "CAUSELEAK41" not in shown and "ConfigSyntaxError" in shown, shown


@pytest.mark.parametrize("value", ["hf_DASHLEAK42abc-tail", "DASHLEAK42ab-cd.ef/gh"])
def test_an_unquoted_secret_with_a_dash_is_left_out_of_the_problem_and_the_fix(tmp_path, value):
    """gin's token ends at the '-', and the message quoted that first part, which was not among the secret's words."""
    message = _error(tmp_path, f"Foo.token = {value}\n")
    assert "DASHLEAK42" not in message, message


def test_a_secret_macro_at_the_end_of_a_long_chain_is_left_out(tmp_path):
    """The pre-scan followed macros of macros 20 deep: the 21st's rejected line printed its value."""
    chain = "".join(f"T{i} = %T{i + 1}\n" for i in range(25))
    message = _error(tmp_path, f"T25 = 'CHAINLEAK43' oops\n{chain}Foo.api_key = %T0\n")
    assert "CHAINLEAK43" not in message, message
