"""gin at the edge: stable names (short and qualified), lazy RL and demo registration, shipped configs by name,
errors before training that name the file and line, the operative config reaching the session."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gin
import pytest

import instrument
from instrument import config
from instrument.errors import ConfigurationError

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "binding",
    ["Instrumentation.log_interval = 3", "IterationStats.channel_dim = 1", "UpdateNorm.alive_channel = 3",
     "TensorBoardBackend.log_dir = None", "WandbBackend.mode = 'offline'", "ConsoleBackend.max_keys = 3",
     "JsonlBackend.path = None", "backend_set.extra = []", "train_nca.steps = 1", "train_cartpole.steps = 1"],
)
def test_every_component_is_configurable_under_its_stable_name(binding):
    import instrument.demos.cartpole  # noqa: F401  (a demo registers its own functions when imported)
    import instrument.demos.nca  # noqa: F401

    instrument.parse_config([], [binding])  # raises "No configurable matching ..." for an unknown name
    name, value = binding.split(" = ")
    assert repr(gin.query_parameter(name)) == value or gin.query_parameter(name) == eval(value)


def test_observers_and_backends_bound_in_gin_file(tmp_path):
    gin_file = tmp_path / "exp.gin"
    gin_file.write_text(
        "include 'backends/jsonl.gin'\n"
        "Instrumentation.observers = [@IterationStats(), @UpdateNorm()]\n"
        "Instrumentation.backends = @backend_set()\n"
        "Instrumentation.log_interval = 5\n"
        "IterationStats.channel_scalars = False\n"
    )
    instrument.parse_config([str(gin_file)])
    inst = instrument.Instrumentation(log_dir=str(tmp_path), run_name="g")
    assert [type(o).__name__ for o in inst.observers] == ["IterationStats", "UpdateNorm"]
    assert isinstance(inst.observers[0], instrument.IterationStats)
    assert [b.name for b in inst.logger.backends] == ["JsonlBackend"]
    assert inst.log_interval == 5 and inst.observers[0].channel_scalars is False
    with inst.step(0):
        pass
    inst.close()
    first = json.loads((tmp_path / "g" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["hyperparameters"]["Instrumentation.log_interval"] == 5
    assert "IterationStats.channel_scalars = False" in first["config"]


@pytest.mark.parametrize(
    "qualified, short, value",
    [("instrument.Instrumentation.log_interval", "Instrumentation.log_interval", 5),
     ("instrument.IterationStats.channel_dim", "IterationStats.channel_dim", 3),
     ("instrument.backend_set.extra", "backend_set.extra", None),
     ("instrument.RLLogging.evaluation", "RLLogging.evaluation", None)],
)
def test_a_binding_may_be_qualified_under_the_instrument_module(qualified, short, value):
    import instrument.config.rl  # noqa: F401  (registers the RL classes)

    instrument.parse_config([], [f"{qualified} = {value!r}"])  # a value of the parameter's annotated type
    assert gin.query_parameter(short) == value and gin.query_parameter(qualified) == value


def test_qualified_bindings_reach_the_class_itself(tmp_path):
    instrument.parse_config([], ["instrument.Instrumentation.log_interval = 7", "IterationStats.channel_dim = 2"])
    inst = instrument.Instrumentation(backends=[], log_dir=str(tmp_path), run_name="q")
    assert inst.log_interval == 7 and instrument.IterationStats().channel_dim == 2
    inst.close()


def test_rl_classes_bind_in_place_once_rl_is_imported(tmp_path):
    from instrument.rl import Evaluation, RLLogging

    instrument.parse_config([], ["RLLogging.evaluation = @Evaluation()", "Evaluation.every_frames = 123"])
    rl = RLLogging()
    assert isinstance(rl.evaluation, Evaluation) and rl.evaluation.every_frames == 123


_IMPORT_PROBE = """
import sys
import torch
before = set(sys.modules)
import instrument
new = sorted(set(sys.modules) - before)
leaks = [m for m in new if m.startswith(("instrument.demos", "instrument.rl"))
         or m.split(".")[0] in ("torchrl", "tensordict", "gymnasium", "wandb", "mlflow", "tqdm", "rich", "moviepy")]
print("LEAKS", leaks)
import gin
try:
    instrument.parse_config([], ["RLLogging.evaluation = None"])
except instrument.ConfigurationError as exc:
    print("BEFORE", exc)
import instrument.rl
instrument.parse_config([], ["RLLogging.evaluation = None"])
print("AFTER ok")
# Another library's `Instrumentation`: the short name is now ambiguous, the qualified one is not.
gin.external_configurable(lambda log_interval=0: None, name="Instrumentation", module="otherlib")
instrument.parse_config([], ["instrument.Instrumentation.log_interval = 3"])
print("QUALIFIED", gin.query_parameter("instrument.Instrumentation.log_interval"))
try:
    instrument.parse_config([], ["Instrumentation.log_interval = 4"])
except KeyError as exc:
    assert isinstance(exc, instrument.ConfigurationError)
    print("AMBIGUOUS", exc)
"""


def test_import_instrument_imports_no_demo_no_rl_and_no_optional_sdk():
    """In a fresh interpreter: the demos, instrument.rl and the optional SDKs stay unimported until used."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], env=env, capture_output=True, text=True,
                         timeout=120, cwd=str(REPO.parent))
    assert out.returncode == 0, out.stderr
    assert "LEAKS []" in out.stdout, out.stdout
    assert "No configurable matching 'RLLogging'" in out.stdout
    assert "import instrument.config.rl" in out.stdout  # the error says how to fix it
    assert "AFTER ok" in out.stdout
    assert "QUALIFIED 3" in out.stdout and "AMBIGUOUS" in out.stdout and "Ambiguous" in out.stdout, out.stdout


def test_the_session_gets_the_operative_config_through_the_installed_source(tmp_path):
    from instrument.session import instrumentation as session

    assert session._config_source is config.operative_config  # installed by instrument.config.registry
    instrument.parse_config([], ["Instrumentation.log_interval = 1", "JsonlBackend.path = None"])
    session.set_config_source(None)
    try:  # without a source, a gin-configured run logs only its own hyperparameters
        inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_dir=str(tmp_path),
                                          run_name="n", hyperparams={"lr": 0.1})
        with inst.step(0):
            pass
        inst.close()
    finally:
        session.set_config_source(config.operative_config)
    first = json.loads((tmp_path / "n" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["hyperparameters"] == {"lr": 0.1} and not first.get("config")


# --------------------------------------------------------------------------------------- shipped configs
def test_a_shipped_config_resolves_by_name_and_by_file_name():
    assert config.resolve_config("nca") == config.CONFIG_DIR / "nca.gin"
    assert config.resolve_config("backends/tensorboard.gin") == config.CONFIG_DIR / "backends" / "tensorboard.gin"
    paths = instrument.parse_config(["nca"], ["train_nca.steps = 2"])
    assert paths == [config.CONFIG_DIR / "nca.gin"] and gin.query_parameter("train_nca.steps") == 2


def test_every_shipped_config_parses_and_has_a_description():
    shipped = config.shipped_configs()
    names = {c.name for c in shipped}
    assert {"nca", "nca_checkpointed", "rl_cartpole", "rl_torchrl_ppo", "backends/tensorboard"} <= names
    assert {c.name for c in shipped if c.runnable} >= {"nca", "nca_checkpointed", "rl_cartpole", "rl_torchrl_ppo"}
    for c in shipped:
        assert c.description.endswith(".") and "gin/" not in c.path.read_text(), c.name
        gin.clear_config()  # parsing imports the demo and instrument.rl, never TorchRL itself
        instrument.parse_config([c.name])


def test_a_file_of_your_own_includes_shipped_configs_and_its_neighbours_win(tmp_path):
    """A user's file anywhere includes shipped fragments by name; a same-named file beside it takes precedence."""
    own = tmp_path / "exp"
    (own / "tables").mkdir(parents=True)
    (own / "tables" / "nca.gin").write_text("ConsoleBackend.max_keys = 2\n")
    (own / "exp.gin").write_text(
        "include 'backends/jsonl.gin'\ninclude 'backends/console.gin'\ninclude 'tables/nca.gin'\n"
        "Instrumentation.backends = @backend_set()\n"
    )
    instrument.parse_config([str(own / "exp.gin")])
    assert gin.query_parameter("ConsoleBackend.max_keys") == 2  # the user's tables/nca.gin, not the shipped one
    assert [type(b).__name__ for b in config.backend_set()] == ["ConsoleBackend", "JsonlBackend"]


def test_gins_own_parser_finds_the_shipped_configs_too(tmp_path):
    (tmp_path / "mine.gin").write_text("include 'backends/tensorboard.gin'\n")
    gin.parse_config_files_and_bindings([str(tmp_path / "mine.gin")], [], finalize_config=False)
    assert [type(b).__name__ for b in config.backend_set()] == ["TensorBoardBackend"]


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "text, kind, where, fix",
    [
        ("Instrumentation.log_intervall = 5\n", ValueError, "exp.gin, line 1", "did you mean 'log_interval'?"),
        ("\nNoSuchObserver.x = 5\n", ValueError, "exp.gin, line 2", "check the spelling"),
        ("\n\nInstrumentation.log_interval = 5 +\n", SyntaxError, "exp.gin, line 3", "quoting, brackets"),
        ("include 'nope/x.gin'\n", FileNotFoundError, "exp.gin, line 1", "shipped config: nca"),
        ("import instrument.nosuch\n", ImportError, "exp.gin, line 1", "import line"),
        ("Instrumentation.observers = [\n", SyntaxError, "exp.gin", "close the bracket"),
    ],
)
def test_bad_files_fail_before_training_naming_file_line_and_fix(tmp_path, text, kind, where, fix):
    gin_file = tmp_path / "exp.gin"
    gin_file.write_text(text)
    with pytest.raises(config.GinConfigError) as info:
        instrument.parse_config([str(gin_file)])
    exc = info.value
    assert isinstance(exc, ConfigurationError) and isinstance(exc, kind) and isinstance(exc, ValueError)
    assert where in exc.where and fix in exc.fix and fix in str(exc)
    assert len(str(exc).splitlines()) <= 4, str(exc)


@pytest.mark.parametrize("written, meant", [("nca", "nca.gin"), ("backends/wandbb.gin", "backends/wandb.gin"),
                                            ("backends/wandb", "backends/wandb.gin")])
def test_a_missing_include_names_the_shipped_configs_as_include_needs_them(tmp_path, written, meant):
    """A review found the fix listing ``nca, backends/wandb`` (which include does not find: it needs the .gin),
    and no "did you mean" for a near miss."""
    (tmp_path / "exp.gin").write_text(f"include '{written}'\n")
    with pytest.raises(config.ConfigFileError) as info:
        instrument.parse_config(["exp.gin"])
    fix = info.value.fix
    assert fix.startswith(f"did you mean {meant!r}? "), fix
    assert "shipped config: nca.gin, " in fix and "backends/wandb.gin" in fix and ", nca," not in fix, fix


def test_an_error_in_a_folder_whose_name_holds_a_double_quote_keeps_its_file_line_and_statement(tmp_path):
    """A review found the file name read up to the first '"': no line, no statement, the top file blamed."""
    folder = tmp_path / 'q"dir'
    folder.mkdir()
    (folder / "top.gin").write_text("include 'nca.gin'\ninclude 'inner.gin'\n")
    (folder / "inner.gin").write_text("train_nca.stepz = 1\n")
    with pytest.raises(config.GinConfigError) as info:
        instrument.parse_config(['q"dir/top.gin'])
    assert info.value.where == 'q"dir/inner.gin, line 1 (included from q"dir/top.gin, line 2)', info.value.where
    assert info.value.statement == "train_nca.stepz = 1"


def test_an_included_file_error_names_both_files(tmp_path):
    (tmp_path / "inner.gin").write_text("UpdateNorm.alive_chanel = 3\n")
    (tmp_path / "outer.gin").write_text("\ninclude 'inner.gin'\n")
    with pytest.raises(ValueError) as info:
        instrument.parse_config([str(tmp_path / "outer.gin")])
    assert "inner.gin, line 1 (included from" in str(info.value) and "outer.gin, line 2" in str(info.value)
    assert "did you mean 'alive_channel'?" in str(info.value)


def test_a_bad_binding_names_the_binding():
    with pytest.raises(config.GinConfigError, match=r"--bind 'Instrumentation.log_intervall = 5'") as info:
        instrument.parse_config([], ["Instrumentation.log_interval = 5", "Instrumentation.log_intervall = 5"])
    assert info.value.statement == "Instrumentation.log_intervall = 5"


def test_missing_config_file_is_explained_with_the_shipped_names():
    with pytest.raises(FileNotFoundError, match="no config file 'ncaa'") as info:
        instrument.parse_config(["ncaa"])
    assert isinstance(info.value, ConfigurationError) and "did you mean 'nca'?" in str(info.value)


def test_parse_config_wants_lists():
    with pytest.raises(ConfigurationError, match="takes lists"):
        instrument.parse_config("exp.gin")


def test_backend_set_rejects_a_non_backend_as_a_type_error():
    with pytest.raises(TypeError, match=r"backend_set.tensorboard got type .*@TensorBoardBackend\(\)") as info:
        config.backend_set(tensorboard=instrument.TensorBoardBackend)  # the class, not an instance
    assert isinstance(info.value, ConfigurationError)
    with pytest.raises(TypeError, match=r"backend_set.extra\[1\] got str"):
        config.backend_set(extra=[instrument.JsonlBackend(), "jsonl"])
    with pytest.raises(TypeError, match=r"backend_set.extra got .*expected a list"):
        config.backend_set(extra=instrument.JsonlBackend())


def test_the_bound_at_line_names_the_binding_at_fault_and_a_dict_bind_reads_whole():
    """A review found 'bound at' blaming backend_set.tensorboard (named in the message's example) for a bad
    backend_set.wandb, and a --bind holding ': ' split in two in the type error's message."""
    files = [str(config.resolve_config("nca"))]
    message = ("backend_set.wandb got str ('offline'); expected a backend instance, e.g. "
               "backend_set.tensorboard = @TensorBoardBackend()\n"
               "  In call to configurable 'backend_set' (<function backend_set>)")
    bind = "backend_set.wandb = 'offline'"
    later = "backend_set.tensorboard = @TensorBoardBackend()"  # named later in the message, bound later
    assert config.where_bound(message, files, [bind, later]) == f"--bind {bind!r}: {bind}"
    with pytest.raises(ConfigurationError) as info:
        instrument.parse_config(["nca"], ["Instrumentation.hyperparams = {1: 'x'}"])
    assert "--bind \"Instrumentation.hyperparams = {1: 'x'}\": Instrumentation.hyperparams expects" in str(
        info.value)


def test_run_without_an_experiment_says_what_to_bind():
    with pytest.raises(config.MissingExperimentError, match="run.experiment = @train_nca"):
        config.run()


def test_an_include_cycle_is_named_instead_of_a_recursion_error(tmp_path, monkeypatch):
    """A review found 3,277 lines of RecursionError for two files that include each other."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.gin").write_text("include 'b.gin'\n")
    (tmp_path / "b.gin").write_text("# b\ninclude 'a.gin'\n")
    (tmp_path / "self.gin").write_text("include 'self.gin'\n")
    with pytest.raises(ConfigurationError, match=r"includes itself, through a.gin, line 1 -> b.gin, line 2 -> a.gin"):
        instrument.parse_config(["a.gin"])
    with pytest.raises(ConfigurationError, match=r"includes itself, through self.gin, line 1 -> self.gin\n"):
        instrument.parse_config(["self.gin"])


def test_an_include_cycle_names_each_file_as_the_other_messages_do(tmp_path, monkeypatch):
    """A review found a cycle through a/x.gin and b/x.gin named ``x.gin, line 2 -> x.gin, line 3 -> x.gin``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "top.gin").write_text("include 'a/x.gin'\n")
    (tmp_path / "a" / "x.gin").write_text("\ninclude '../b/x.gin'\n")
    (tmp_path / "b" / "x.gin").write_text("\n\ninclude '../a/x.gin'\n")
    with pytest.raises(ConfigurationError) as raised:
        instrument.parse_config(["top.gin"])
    assert "through a/x.gin, line 2 -> a/../b/x.gin, line 3 -> a/x.gin\n" in str(raised.value), raised.value


def test_a_file_that_includes_itself_several_times_is_read_a_few_times_not_3_to_the_20th(tmp_path, monkeypatch):
    """A review found the secret_keys pre-scan walking every include again at each depth (no record of the files
    read): three self-includes meant 3^20 reads before gin's cycle error. Each file is now read once there."""
    from instrument.config import located

    monkeypatch.chdir(tmp_path)
    reads = []

    def counted(path: str) -> str:
        reads.append(path)
        if len(reads) > 200:  # the old walk would go on for hours
            raise RuntimeError("read too often")
        return real(path)

    real = located.read_text
    monkeypatch.setattr(located, "read_text", counted)
    (tmp_path / "self3.gin").write_text("include 'self3.gin'\n" * 3)
    with pytest.raises(ConfigurationError, match=r"includes itself, through self3.gin, line 1 -> self3.gin\n"):
        instrument.parse_config(["self3.gin"])
    assert len(reads) < 20


def test_small_setting_checks_found_by_review(tmp_path):
    """max_keys=-1 silently dropped the last column, train_nca(steps=-5) 'succeeded' with a NaN loss, and
    gin's 'No module named ...' lost its closing quote."""
    with pytest.raises(ConfigurationError, match=r"max_keys must be an int >= 1, got -1"):
        instrument.ConsoleBackend(max_keys=-1)
    from instrument.demos.nca import train_nca

    with pytest.raises(ConfigurationError, match=r"train_nca steps must be an int >= 1, got -5"):
        train_nca(steps=-5)
    with pytest.raises(ConfigurationError, match=r"train_nca batch_size must be an int >= 1, got 0"):
        train_nca(batch_size=0)
    (tmp_path / "imp.gin").write_text("import no_such_module_xyz\n")
    with pytest.raises(ConfigurationError, match=r"No module named 'no_such_module_xyz'"):
        instrument.parse_config([str(tmp_path / "imp.gin")])


def test_bound_at_follows_the_scope_gin_names_and_falls_back_as_gin_does():
    """A review found 'bound at' blaming an unused scoped binding, or the unscoped one for a call in scope 'a'."""
    message = ("ConsoleBackend max_keys must be an int >= 1, got -1.\n  In call to configurable 'ConsoleBackend' "
               "(<class 'instrument.backends.console.ConsoleBackend'>){}")
    binds = ["a/ConsoleBackend.max_keys = -1", "ConsoleBackend.max_keys = -1", "other/ConsoleBackend.max_keys = 4"]
    assert config.where_bound(message.format(" in scope 'a'"), [], binds).endswith(": a/ConsoleBackend.max_keys = -1")
    assert config.where_bound(message.format(""), [], binds).endswith(": ConsoleBackend.max_keys = -1")
    assert config.where_bound(message.format(" in scope 'b/c'"), [], binds[1:2]).endswith(
        ": ConsoleBackend.max_keys = -1")  # no binding in 'b/c' or 'b': gin reads the unscoped one


def test_a_refused_console_column_says_where_it_was_bound_and_a_lone_key_gets_a_list_as_the_fix():
    """A review found a Column refused while ConsoleBackend was built reported with no 'bound at' (its message
    named no parameter), and `ConsoleBackend.columns = 'train/loss'` answered with the fix `[@Name(), @Name()]`."""
    bind = 'ConsoleBackend.columns = [("train/loss", "loss", 2)]'
    with pytest.raises(ConfigurationError) as info:
        instrument.ConsoleBackend(columns=[("train/loss", "loss", 2)])
    message = f"{info.value}\n  In call to configurable 'ConsoleBackend' (<class 'ConsoleBackend'>)"
    assert str(info.value).startswith("ConsoleBackend columns: Column 'train/loss': width must be")
    assert config.where_bound(message, [], [bind]) == f"--bind {bind!r}: {bind}"
    with pytest.raises(ConfigurationError, match=r"e\.g\. ConsoleBackend\.columns = \['train/loss'\]"):
        instrument.parse_config(["nca"], ["ConsoleBackend.columns = 'train/loss'"])


def test_a_config_saved_as_utf8_with_a_bom_is_read(tmp_path):
    """A review found a .gin file saved "UTF-8 with BOM" (Notepad) refused with "syntax error: Unexpected
    token" at line 1, quoting a statement that looks right: the BOM is dropped, as Python drops it from its own
    sources, in included files too, and a binding after it is still located by its line."""
    (tmp_path / "inner.gin").write_bytes("\ufeffInstrumentation.log_interval = 7\n".encode())
    (tmp_path / "bom.gin").write_bytes("\ufeffinclude 'nca.gin'\ninclude 'inner.gin'\ntrain_nca.steps = 'ten'\n"
                                       .encode())
    with pytest.raises(config.GinConfigError) as info:
        config.parse_config([str(tmp_path / "bom.gin")])
    assert info.value.where.endswith("bom.gin, line 3") and "train_nca.steps expects int" in str(info.value)
    gin.clear_config()
    (tmp_path / "bom.gin").write_bytes("\ufeffinclude 'nca.gin'\ninclude 'inner.gin'\ntrain_nca.steps = 2\n".encode())
    config.parse_config([str(tmp_path / "bom.gin")])
    assert gin.query_parameter("train_nca.steps") == 2 and gin.query_parameter("Instrumentation.log_interval") == 7


def test_a_start_that_fails_under_the_cli_says_so_in_the_clis_own_words(tmp_path):
    """A review found ``WARNING:instrument:instrument: the start of run ... failed`` before the real error, as
    if something had crashed: gin's module-level logging calls had configured the root logger
    (``logging.basicConfig``) while the config was parsed. The root logger is left as it was found."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "instrument", "run", "nca", "--bind", "Instrumentation.flush_secs = 0"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2 and "flush_secs must be a number of seconds > 0, got 0" in out.stderr, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].startswith("instrument: the start of run ") and "WARNING:" not in out.stderr, out.stderr
    assert all(line.startswith(("instrument: ", "  ", "(instrument run")) for line in lines), out.stderr


@pytest.mark.parametrize("value, said, fix", [
    ("nan", "'nan' is not a gin value: gin reads Python literals, and NaN has none",
     "bind a number, e.g. Instrumentation.overhead_budget = 0.1."),
    ("float('nan')", "float(...) is a call, not a gin value", "Instrumentation.overhead_budget = 0.1; infinity is "
     "written 1e999"),
    ("inf", "'inf' is not a gin value: gin reads Python literals, which name no infinity", "write 1e999"),
    ("-inf", "'-inf' is not a gin value: gin reads Python literals, which name no infinity",
     "write 1e999 (-1e999 for minus infinity)"),
])
def test_nan_and_infinity_are_said_to_have_no_gin_literal_with_what_to_write(value, said, fix):
    """A review found ``log_interval = nan`` answered with ``malformed node or string ... <ast.Name object at
    0x...>``. Each fix it names parses and is taken (1e999 is infinity, as Python reads it)."""
    with pytest.raises(config.ConfigSyntaxError) as info:
        config.parse_config(["nca"], [f"Instrumentation.overhead_budget = {value}"])
    assert said in info.value.problem and fix in info.value.fix and "ast.Name" not in str(info.value), info.value
    for right in ("0.1", "1e999"):
        gin.clear_config()
        config.parse_config(["nca"], [f"Instrumentation.overhead_budget = {right}"])
        assert gin.query_parameter("Instrumentation.overhead_budget") == float(right)
