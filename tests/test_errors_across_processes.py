"""instrument's errors cross process boundaries: a multiprocessing ``Pool`` worker's error reaches the parent.

A pool pickles a task's exception in the worker and unpickles it in the parent's result thread. Two of
instrument's errors could not make that trip. A session whose start fails raises its `ConfigurationError`
through gin (``Instrumentation`` is a configurable), which re-raises it as a subclass made on the spot that
pickle cannot name: the parent got ``MaybeEncodingError: ... PicklingError`` and never learned why the run did
not start. `MissingExtraError` pickled, but ``cls(*args)`` could not build it again in the parent: the pool's
result thread died and ``pool.map`` waited forever.
"""

import pickle
import textwrap

from instrument.config.experiment import BackendTypeError
from instrument.config.files import ConfigFileError, ConfigImportError, ConfigSyntaxError, GinConfigError
from instrument.errors import (
    ConfigurationError,
    InvalidValueError,
    MissingExtraError,
    NonFiniteError,
    ProbeError,
    StepOrderError,
)
from tests.conftest import run_child

POOL = textwrap.dedent(
    """
    import multiprocessing, sys
    import instrument
    from instrument.errors import MissingExtraError

    class Unreachable(instrument.Backend):
        def open(self, run):
            raise RuntimeError("the store is unreachable")

        def write(self, record):
            pass

    def start(root):
        instrument.Instrumentation(log_dir=root, run_name="trial", backends=[Unreachable()])

    def missing(root):
        raise MissingExtraError("wandb", "wandb", "WandbBackend")

    if __name__ == "__main__":
        with multiprocessing.get_context(sys.argv[2]).Pool(1) as pool:
            for task in (start, missing):
                try:
                    pool.apply_async(task, (sys.argv[1],)).get(timeout=20)
                except Exception as exc:
                    print(f"{task.__name__}: {type(exc).__name__}: {exc}".replace("\\n", " "), flush=True)
    """
)


def test_a_pool_workers_failed_start_and_missing_extra_reach_the_parent(tmp_path):
    out = run_child(tmp_path, POOL, str(tmp_path), "fork", timeout=90)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("start: ConfigurationError: could not open Unreachable: RuntimeError: the store is "
                               "unreachable"), out.stdout + out.stderr
    assert "In call to configurable 'Instrumentation'" in lines[0]  # gin's part of the message comes along
    assert lines[1] == ("missing: MissingExtraError: WandbBackend needs the 'wandb' package, which is not installed. "
                        "Install it with: pip install 'torch-instrument[wandb]'"), out.stdout + out.stderr


def test_every_error_class_pickles_as_itself_with_its_message_and_attributes():
    errors = [ConfigurationError("a"), ProbeError("b"), StepOrderError("c"), InvalidValueError("d"),
              NonFiniteError("e"), MissingExtraError("wandb", "wandb", "W&B"),
              MissingExtraError("mlflow", "mlflow", "MLflow", broken=ImportError("no sqlalchemy")),
              GinConfigError("bad", "f.gin:3", "a = b", "fix it"), ConfigFileError("no such file"),
              ConfigSyntaxError("cannot parse", "f.gin:1"), ConfigImportError("no module"), BackendTypeError("bt")]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and copy.args == error.args and str(copy) == str(error)
        assert vars(copy) == vars(error)
    missing = pickle.loads(pickle.dumps(errors[5]))
    assert (missing.name, missing.package, missing.extra) == ("wandb", "wandb", "wandb")


def test_an_error_that_pickle_cannot_name_is_pickled_as_its_own_named_class_never_one_handled_around_it():
    """A gin proxy, or a local subclass, raised while another of instrument's errors was being handled: the walk
    for its attributes took that other error (a ConfigurationError came back as a MissingExtraError), and a
    context chain that loops made pickling hang."""

    def raised_while_handling():
        class LocalError(ConfigurationError):  # pickle cannot name it: a function's own class
            pass

        try:
            try:
                raise MissingExtraError("mlflow", "mlflow", "MLflow")
            except MissingExtraError:
                raise LocalError("local problem")  # noqa: B904 (the context is the point)
        except LocalError as error:
            return error

    copy = pickle.loads(pickle.dumps(raised_while_handling()))
    assert type(copy) is ConfigurationError and str(copy) == "local problem" and not hasattr(copy, "package")

    class Unnamed(ConfigurationError):
        pass

    first, second = Unnamed("first"), RuntimeError("second")
    first.__context__, second.__context__ = second, first  # a loop
    copy = pickle.loads(pickle.dumps(first))
    assert type(copy) is ConfigurationError and str(copy) == "first"
