"""The parse-time type check of gin bindings: a literal that its parameter's annotation rules out is refused
before anything is built, naming the file and line (or the --bind), what was received, what was expected and
a binding that fits; every annotation form researchers use is judged, to any depth, and nothing it cannot
judge (references, macros, Any, Callable, classes, TypeVars, forward references) is ever refused."""

from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, TypeVar

import gin
import pytest

import instrument
from instrument.config.parse import ConfigTypeError
from instrument.errors import ConfigurationError

T = TypeVar("T")


def forms(*, counts: List[int] = (), pair: tuple = (), rates: Dict[str, float] = None,
          grid: Sequence[Sequence[int]] = (), modern: list[int] | None = None, ratio: float = 0.5,
          flag: bool = False, steps: int = 1, plain=None, anything: Any = None, fn: Callable[..., Any] = None,
          path: Path = None, generic: T = None, env: Dict[str, str] = None,
          later: "NotDefinedAnywhere" = None) -> None:  # noqa: F821 - a forward reference that never resolves
    """Annotated with the forms no shipped configurable uses, and with some the check cannot judge."""


gin.configurable("forms", module="tests_config_types")(forms)


def _parse(tmp_path, body: str, *bindings: str):
    gin_file = tmp_path / "exp.gin"
    gin_file.write_text("import instrument.config.rl\n# a comment line\n" + body + "\n")
    return instrument.parse_config([str(gin_file)], list(bindings))


def _refused(tmp_path, body: str, *bindings: str) -> ConfigTypeError:
    with pytest.raises(ConfigTypeError) as info:
        _parse(tmp_path, body, *bindings)
    exc = info.value
    assert isinstance(exc, TypeError) and isinstance(exc, ConfigurationError) and isinstance(exc, ValueError)
    assert len(str(exc).splitlines()) <= 4, str(exc)
    return exc


# (a wrong binding, what the error says it got and expected, the fix it proposes; a right binding)
CASES = [
    # Literal (TensorBoardBackend.video_format: Literal["gif", "filmstrip"])
    ("TensorBoardBackend.video_format = 'mp4'",
     ["expects one of 'gif', 'filmstrip', got 'mp4' (str)"], "TensorBoardBackend.video_format = 'gif'",
     "TensorBoardBackend.video_format = 'filmstrip'"),
    ("GradientStats.per = 'layer'", ["one of 'param', 'module', 'global', got 'layer'"], "GradientStats.per = 'param'",
     "GradientStats.per = 'module'"),
    # Sequence[int] (RolloutVideo.channels), an item of the wrong type; a tuple fits as well as a list
    ("RolloutVideo.channels = [0, 'one', 2]", ["expects a list of int", "item 1 is 'one' (str), not int"],
     "RolloutVideo.channels = (0, 1, 2, 3)", "RolloutVideo.channels = (0, 1, 2)"),
    ("StateHistogram.iterations = 'last'", ["expects int or a list of int, got 'last' (str)"],
     "StateHistogram.iterations = (-1,)", "StateHistogram.iterations = -1"),
    ("Evaluation.modes = ['deterministic', 'greedy']",
     ["expects a list of (one of 'deterministic', 'stochastic')", "item 1 is 'greedy' (str)"],
     "Evaluation.modes = ('deterministic', 'stochastic')", "Evaluation.modes = ('stochastic',)"),
    # a string where a list of strings is expected (a str is a Sequence of str to Python)
    ("ConsoleBackend.keys = 'loss'", ["expects a list of str or None, got 'loss' (str)", "a string is not a list"],
     "ConsoleBackend.keys = ['loss']", "ConsoleBackend.keys = ['loss', 'lr']"),
    ("RunHistoryBackend.batch_keys = 'loss'", ["expects a list of str, got 'loss'"],
     "RunHistoryBackend.batch_keys = ['loss']", "RunHistoryBackend.batch_keys = ('loss', 'lr')"),
    ("WandbBackend.tags = 'nca'", ["expects a list of str or None"], "WandbBackend.tags = ['nca']",
     "WandbBackend.tags = None"),
    ("Instrumentation.observers = 'IterationStats'", ["expects a list of (Observer or Callable)", "not a list"],
     "Instrumentation.observers = [@Name()]", "Instrumentation.observers = []"),
    # Tuple[float, float] (RolloutVideo.value_range): length and items; an int fits float, a list fits a tuple
    ("RolloutVideo.value_range = (0, 1, 2)", ["expects a tuple (float, float) or None", "3 items, not 2"],
     "RolloutVideo.value_range = (0.0, 1.0) with RolloutVideo.channels = [0]", "RolloutVideo.value_range = [0, 1.0]"),
    ("RolloutVideo.value_range = (0.0, True)", ["item 1 is True (bool), not float"],
     "RolloutVideo.value_range = (0.0, 1.0) with RolloutVideo.channels = [0]", "RolloutVideo.value_range = (-1, 1)"),
    # Mapping[str, str] (MlflowBackend.tags) and Dict[str, Any] (Instrumentation.hyperparams)
    ("MlflowBackend.tags = ['team']", ["expects a dict of str to Any or None, got ['team'] (list)"],
     "MlflowBackend.tags = {'name': None}", "MlflowBackend.tags = {'team': 'nca', 'epochs': 5}"),
    ("Instrumentation.hyperparams = {1: 'x'}", ["key 1 is 1 (int), not str"], "{'name': ",
     "Instrumentation.hyperparams = {'lr': 0.1, 'layers': [1, 2]}"),
    # nested: Optional[Mapping[str, Union[str, Tuple[str, ...]]]] (CollectionMetrics.keys)
    ("CollectionMetrics.keys = {'reward': ('next', 5)}", ["value of 'reward', item 1 is 5 (int), not str"],
     "CollectionMetrics.keys = {'name': 'name'}", "CollectionMetrics.keys = {'reward': ('next', 'reward')}"),
    # Union[str, Tuple[str, ...]] (Counters.done_key)
    ("Counters.done_key = 5", ["expects str or a tuple of str, got 5"], "Counters.done_key = ('next', 'done')",
     "Counters.done_key = ('next', 'done')"),
    # forms no shipped configurable uses: List[int], bare tuple, Dict[str, float], nested sequences, PEP 585/604
    ("forms.counts = [1, 2.5]", ["item 1 is 2.5 (float), not int"], "forms.counts = [10]",
     "forms.counts = (1, 2)"),
    ("forms.pair = 'ab'", ["expects a tuple, got 'ab'"], "forms.pair = ('ab',)", "forms.pair = [1, 'b']"),
    ("forms.rates = {'a': 'fast'}", ["a dict of str to float", "value of 'a' is 'fast'"],
     "forms.rates = {'name': 0.5}", "forms.rates = {'a': 1, 'b': 0.5}"),
    ("forms.grid = [[1, 2], [3, None]]", ["item 1, item 1 is None (NoneType), not int"],
     "forms.grid = [[10]]", "forms.grid = [(1, 2), [3]]"),
    ("forms.modern = ['1']", ["expects a list of int or None", "item 0 is '1' (str), not int"],
     "forms.modern = [10]", "forms.modern = [1]"),
    # numbers: a bool is neither an int nor a float, an int is a float
    ("forms.steps = True", ["forms.steps expects int, got True (bool)"], "forms.steps = 1", "forms.steps = 3"),
    ("forms.ratio = False", ["expects float, got False (bool)"], "forms.ratio = 0.5", "forms.ratio = 1"),
    ("forms.flag = 1", ["expects bool, got 1 (int)"], "forms.flag = False", "forms.flag = False"),
]


@pytest.mark.parametrize("wrong, said, fix, right", CASES, ids=[c[0].split(" =")[0] for c in CASES])
def test_a_wrong_literal_is_refused_naming_file_line_what_and_a_fix(tmp_path, wrong, said, fix, right):
    exc = _refused(tmp_path, "TensorBoardBackend.flush_every_commit = True\n" + wrong)
    assert exc.where.endswith("exp.gin, line 4") and exc.statement == wrong
    for part in said:
        assert part in exc.problem, exc.problem
    assert fix in exc.fix and "e.g." in exc.fix, exc.fix
    assert str(exc).startswith(f"{exc.where}: {wrong.split(' =')[0]} expects")
    gin.clear_config()
    _parse(tmp_path, "TensorBoardBackend.flush_every_commit = True\n" + right)  # the right one passes
    selector, value = right.split(" = ")
    assert gin.query_parameter(selector.replace("forms.", "tests_config_types.forms.")) == eval(value)


def test_a_wrong_bind_names_the_bind():
    with pytest.raises(ConfigTypeError) as info:
        instrument.parse_config(["nca"], ["RolloutVideo.channels = 'rgb'"])
    assert info.value.where == "--bind \"RolloutVideo.channels = 'rgb'\""
    assert "expects a list of int, got 'rgb' (str)" in str(info.value)


def test_a_wrong_literal_in_an_included_file_names_that_file_and_the_include(tmp_path):
    (tmp_path / "inner.gin").write_text("\n\nConsoleBackend.keys = 'loss'\n")
    (tmp_path / "outer.gin").write_text("include 'nca.gin'\ninclude 'inner.gin'\n")
    with pytest.raises(ConfigTypeError) as info:
        instrument.parse_config([str(tmp_path / "outer.gin")])
    assert info.value.where == f"{tmp_path}/inner.gin, line 3 (included from {tmp_path}/outer.gin, line 2)"
    assert info.value.statement == "ConsoleBackend.keys = 'loss'"


def test_a_scoped_binding_is_located_by_its_scope(tmp_path):
    exc = _refused(tmp_path, "RolloutVideo.channels = [0, 1, 2]\neval/RolloutVideo.channels = ['r']\n"
                             "train/RolloutVideo.channels = [0]")
    assert exc.where.endswith("exp.gin, line 4") and exc.statement == "eval/RolloutVideo.channels = ['r']"
    assert "e.g. eval/RolloutVideo.channels = ['r']" not in exc.fix  # 'r' is no int: a generic example
    assert "eval/RolloutVideo.channels expects a list of int" in exc.problem


def test_a_secret_in_a_refused_value_is_left_out_of_the_error(tmp_path):
    secret = "hf_Secret12345678"
    binding = f"forms.env = {{'hf_token': '{secret}', 'epochs': 5}}"
    exc = _refused(tmp_path, binding)
    assert "value of 'epochs' is 5 (int), not str" in exc.problem and "<redacted>" in str(exc)
    assert secret not in str(exc) and exc.where.endswith("exp.gin, line 3")
    gin.clear_config()
    with pytest.raises(ConfigTypeError) as info:
        instrument.parse_config([], [binding])
    assert secret not in str(info.value) and "value of 'epochs'" in str(info.value)


def test_the_last_binding_is_the_one_judged(tmp_path):
    _parse(tmp_path, "RolloutVideo.channels = 'rgb'\nRolloutVideo.channels = [0, 1, 2]")  # overridden: fine
    gin.clear_config()
    exc = _refused(tmp_path, "RolloutVideo.channels = [0, 1, 2]\nRolloutVideo.channels = 'rgb'")
    assert exc.where.endswith("exp.gin, line 4")


def test_references_and_macros_are_not_judged(tmp_path):
    _parse(tmp_path, "\n".join([
        "CHANNELS = [0, 1, 2]",
        "KEYS = 'loss'",  # a macro is resolved when called: not judged, even when it is wrong
        "RolloutVideo.channels = %CHANNELS",
        "ConsoleBackend.keys = %KEYS",
        "Instrumentation.observers = [@IterationStats(), @RolloutVideo()]",
        "Instrumentation.backends = @backend_set()",
        "backend_set.extra = [@JsonlBackend()]",
        "forms.counts = [1, %CHANNELS]",  # the literal items are judged, the macro is not
        "forms.rates = {'a': %CHANNELS}",
        "Instrumentation.run_log = @setup_run_logging",
        "tests_config_types.forms.steps = %STEPS",
        "STEPS = 3",
    ]))
    gin.clear_config()
    exc = _refused(tmp_path, "CHANNELS = 3\nforms.counts = [%CHANNELS, 'x']")
    assert "item 1 is 'x' (str), not int" in exc.problem


@pytest.mark.parametrize("binding", [
    "forms.plain = 'anything'", "forms.anything = {'a': [1, 'b']}", "forms.fn = 'not callable'",
    "forms.path = 'runs/x'", "forms.generic = 3", "forms.later = [1]", "forms.rates = None",  # the default
    "IterationStats.color_range = (0, 1)", "Instrumentation.system_monitor = True",
    "ConsoleBackend.columns = ['loss', {'key': 'lr', 'fmt': '.2e'}, ('step', 'Step')]",
    "ProgressBar.reward_keys = {'reward': 'Reward'}", "GradientStats.include = 'encoder'",
    "GradientStats.include = ['encoder', 'decoder']", "Column.denominator = 3",
])
def test_no_false_error_for_what_cannot_be_judged_or_fits(tmp_path, binding):
    _parse(tmp_path, binding)


def test_a_tightened_shipped_annotation_still_takes_every_value_it_took():
    instrument.parse_config(["nca"], ["TensorBoardBackend.video_format = 'filmstrip'",
                                      "Instrumentation.on_full = 'drop'", "Instrumentation.on_backend_error = 'warn'",
                                      "Instrumentation.on_step_regression = 'warn'", "RLLogging.step_unit = 'frames'"])
    assert gin.query_parameter("TensorBoardBackend.video_format") == "filmstrip"
    assert gin.query_parameter("RLLogging.step_unit") == "frames"


def _registered():
    """(gin name, configurable) of every class and function registered under instrument's module."""
    import instrument.config.rl  # noqa: F401 - registers the RL classes
    from instrument.config.registry import MODULE

    return sorted(((selector.rsplit(".", 1)[-1], conf) for selector, conf in gin.config._REGISTRY.items()
                   if selector.startswith(MODULE + ".") and selector.count(".") == 1), key=lambda item: item[0])


# Received values to provoke a refusal with: a string, a number, a dict, a list of a dict (one of them is wrong
# for every judged parameter).
_WRONG = ["'abc'", "7", "{'x': 1}", "[{'x': 1}]", "3.5"]


def test_every_suggested_fix_is_accepted_when_applied(tmp_path, monkeypatch):
    """A review found suggested fixes that the class itself refused (``RolloutVideo.value_range = (0.5, 0.5)``:
    low < high; ``ConsoleBackend.width = 10``: >= 20; ``channel_names = ['name', 'name']``: unique). For every
    parameter of every registered class that the check judges, each wrong value it refuses is refused with a
    fix; that fix, applied through gin, passes the check and the class is built with it (functions are not
    called: they train)."""
    import ast
    import inspect

    from instrument.config import types
    from instrument.config.parse import check_types

    checked = 0
    for name, configurable in _registered():
        fn = configurable.wrapped
        for param in types.hints_of(fn):
            if param == "return":
                continue
            for wrong in _WRONG:
                refused = types.refusal(fn, name, param, ast.literal_eval(wrong))
                if refused is None:
                    continue
                assert "e.g. " in refused[1], refused
                fix = refused[1].split("e.g. ", 1)[1].rstrip(".").split(" with ")  # a binding, maybe another
                assert fix[0].startswith(f"{name}.{param} = "), fix
                if "@" in fix[0]:  # a reference to a configurable: not a literal to apply here
                    continue
                gin.clear_config()
                for binding in fix:
                    gin.parse_config(binding)
                check_types([], fix)  # the fix passes the type check ...
                checked += 1
                if not inspect.isclass(fn):
                    continue
                bound = [b.split(" = ")[0].rsplit(".", 1)[1] for b in fix]
                required = [p for p, v in inspect.signature(fn).parameters.items() if p not in ("self", *bound)
                            and v.default is inspect.Parameter.empty and v.kind is v.POSITIONAL_OR_KEYWORD]
                # ... and the class takes it (gin passes the bound value; a refusal raises here), in a folder
                # of its own (a suggested run_name is taken once per folder)
                monkeypatch.chdir(tmp_path)
                (tmp_path / str(checked)).mkdir()
                monkeypatch.chdir(tmp_path / str(checked))
                built = gin.get_configurable(f"instrument.{name}")(
                    **{p: ast.literal_eval(types.example(types.hints_of(fn)[p])) for p in required})
                close = getattr(built, "close", None)
                if callable(close):
                    close()
    assert checked > 50, checked
