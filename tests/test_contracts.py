"""Contract suites: every Backend, Observer and RL component in the library, found automatically, goes through
the lifecycle its base class documents (Composer's callback tests do the same).

Discovery imports every module of the package (``pkgutil``) and walks ``__subclasses__()`` recursively, keeping
the classes defined in ``instrument``. A class is built with its defaults unless FACTORIES says how; a new class
that cannot be built with its defaults and has no FACTORIES entry fails here with a message saying to add one,
so nothing escapes the suite. Results are read back from the files a user would open (a JSONL metrics file).
"""

import importlib
import inspect
import io
import json
import math
import pkgutil
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Set, Type

import numpy as np
import pytest
import torch

import instrument
from instrument.backends.base import Backend, RunInfo, SampleTable, StepRecord
from instrument.backends.jsonl import JsonlBackend
from instrument.core.context import StepContext
from instrument.core.observer import Observer
from instrument.errors import MissingExtraError
from instrument.logger.logger import Logger
from instrument.rl.component import RLComponent
from instrument.rl.counters import Counters

# Optional SDKs: a module that cannot be imported without one is skipped with that reason, not failed.
OPTIONAL_SDKS = {"wandb", "mlflow", "torchrl", "tensordict", "gymnasium", "moviepy", "rich", "tqdm"}
# Never imported for discovery: running it runs the CLI.
NOT_IMPORTED = {"instrument.__main__"}


def _import_everything() -> Dict[str, str]:
    """Import every module of the package; returns {module: reason} for those an absent optional SDK stops."""
    skipped: Dict[str, str] = {}
    for info in pkgutil.walk_packages(instrument.__path__, prefix="instrument."):
        if info.name in NOT_IMPORTED:
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as error:
            missing = (error.name or "").split(".")[0]
            if missing not in OPTIONAL_SDKS:
                raise
            skipped[info.name] = f"{info.name} needs the optional package {missing!r}, which is not installed"
    return skipped


SKIPPED_MODULES = _import_everything()


def discover(base: type) -> List[type]:
    """Every subclass of ``base`` (recursively) defined in the library, sorted by qualified name."""
    found: Set[type] = set()
    todo = [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.add(sub)
                todo.append(sub)
    return sorted(
        (cls for cls in found if cls.__module__.startswith("instrument.") and not inspect.isabstract(cls)),
        key=lambda cls: f"{cls.__module__}.{cls.__qualname__}",
    )


def _id(cls: type) -> str:
    return cls.__qualname__


def build(cls: type, tmp_path: Path) -> Any:
    """The class's FACTORIES entry called with ``tmp_path``, else the class built with its defaults."""
    factory = FACTORIES.get(cls.__qualname__)
    if factory is not None:
        return factory(tmp_path)
    try:
        inspect.signature(cls).bind()
    except TypeError as error:
        pytest.fail(
            f"{cls.__module__}.{cls.__qualname__} cannot be built with its defaults ({error}); add an entry for "
            f"{cls.__qualname__!r} to FACTORIES in {Path(__file__).name} so the contract suite runs it."
        )
    return cls()


def _model_with_gradients(nan: bool = False) -> torch.nn.Module:
    """A small model whose parameters hold gradients (what GradientStats and NonFinite read)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model(torch.randn(5, 3)).square().sum().backward()
    if nan:
        model[0].weight.grad[0, 0] = float("nan")
    return model


def _nonfinite_under_a_scaler() -> Any:
    """NonFinite as a session with ``grad_scaler=`` hands it over (every key documented, ``loss_scale`` too)."""
    from instrument.core.loss_scale import LossScale

    observer = instrument.NonFinite(module=_model_with_gradients(nan=True))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first scale() call
    observer.loss_scale = LossScale(scaler)
    return observer


def _fixed_episode_runner(deterministic: bool, max_steps: int, render: bool):
    """An episode runner (the user-supplied callable Evaluation calls): a fixed 3-step episode."""
    from instrument.rl.evaluation import Episode

    return Episode(return_=1.5 if deterministic else 0.5, length=3)


# Class name -> how to build one in a test's tmp_path. Classes whose defaults suffice need no entry.
FACTORIES: Dict[str, Callable[[Path], Any]] = {
    # backends: keep their output inside tmp_path and off the terminal
    "ConsoleBackend": lambda tmp: instrument.ConsoleBackend(stream=io.StringIO(), legend=False),
    "JsonlBackend": lambda tmp: JsonlBackend(path=str(tmp / "metrics.jsonl")),
    "MlflowBackend": lambda tmp: instrument.MlflowBackend(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}"),
    "ProgressBar": lambda tmp: instrument.rl.ProgressBar(enabled=True, total_frames=100, stream=io.StringIO()),
    "TensorBoardBackend": lambda tmp: instrument.TensorBoardBackend(log_dir=str(tmp / "tb")),
    "WandbBackend": lambda tmp: instrument.WandbBackend(project="contracts", mode="offline"),
    # RL components
    "ProgressComponent": lambda tmp: __import__("instrument.rl.bar", fromlist=["ProgressComponent"]).ProgressComponent(
        instrument.rl.ProgressBar(enabled=True, total_frames=100, stream=io.StringIO()), total_frames=100
    ),
    "Evaluation": lambda tmp: instrument.rl.Evaluation(every_frames=4, at_start=True, runner=_fixed_episode_runner),
    # observers of a model's parameters: one with gradients (NaN in one, for NonFinite's gradient keys)
    "GradientStats": lambda tmp: instrument.GradientStats(module=_model_with_gradients(), histograms=True),
    "NonFinite": lambda tmp: _nonfinite_under_a_scaler(),
    # observers: every documented key logged (the suffixed keys of the non-last iterations included)
    "StateHistogram": lambda tmp: instrument.StateHistogram(iterations=(0, -1)),
}

# RL components that log nothing from batches and losses alone, and why (they still run the whole lifecycle).
SILENT_COMPONENTS = {
    "ProgressComponent": "a display: it shows values the other components log, and logs none itself",
    "StageTiming": "it logs what rl.timer(...) measured, and no timer ran here",
}

BACKENDS = discover(Backend)
OBSERVERS = discover(Observer)
RL_COMPONENTS = discover(RLComponent)


def test_discovery_finds_the_built_ins():
    names = {cls.__qualname__ for cls in BACKENDS}
    assert {"TensorBoardBackend", "WandbBackend", "MlflowBackend", "JsonlBackend", "ConsoleBackend",
            "RunHistoryBackend", "ProgressBar"} <= names
    assert {"IterationStats", "UpdateNorm"} <= {cls.__qualname__ for cls in OBSERVERS}
    assert {"CollectionMetrics", "TrainMetrics", "Counters"} <= {cls.__qualname__ for cls in RL_COMPONENTS}


def test_every_module_was_searched():
    if SKIPPED_MODULES:
        pytest.skip("not searched for subclasses: " + "; ".join(SKIPPED_MODULES.values()))
    assert "instrument.rl.torchrl" in sys.modules


def test_a_new_subclass_without_defaults_or_factory_fails_with_instructions(tmp_path):
    class NeedsArgs(Backend):
        def __init__(self, where: str) -> None:
            self.where = where

    with pytest.raises(pytest.fail.Exception, match=r"add an entry for 'test_a_new_subclass.*NeedsArgs' to FACTORIES"):
        build(NeedsArgs, tmp_path)


# ------------------------------------------------------------------------------------------------ backends
def _record(step: int) -> StepRecord:
    image = np.zeros((8, 10, 3), dtype=np.uint8)
    image[:, :, 0] = np.arange(10, dtype=np.uint8) * 25
    video = np.zeros((3, 8, 10, 3), dtype=np.uint8)
    video[:, :, :, 1] = np.arange(3, dtype=np.uint8)[:, None, None] * 100
    return StepRecord(
        step=step,
        scalars={"train/loss": 1.0 / (step + 1), "train/acc": 0.5, "counters/frames": 8.0 * (step + 1)},
        images={"state/rgb": image},
        histograms={"update_norm/l2": np.linspace(0.0, 1.0, 17)},
        texts={"note": f"step {step}: hello"},
        videos={"rollout/video": (video, 5)},
        samples={"val": SampleTable(rows=[{"input": "a", "output": "b", "score": 0.25}])},
        timings={"rollout": {"mean": 0.1, "min": 0.05, "max": 0.2, "count": 3.0}},
    )


def _backend(cls: type, tmp_path: Path) -> Backend:
    backend = build(cls, tmp_path)
    assert isinstance(backend, Backend) and type(backend) is cls
    return backend


def _open(backend: Backend, tmp_path: Path) -> None:
    try:
        backend.open(RunInfo("contract", tmp_path))
    except MissingExtraError as error:
        pytest.skip(f"{type(backend).__name__}: optional SDK not installed ({error})")


@pytest.mark.parametrize("cls", BACKENDS, ids=_id)
def test_backend_lifecycle(cls: Type[Backend], tmp_path):
    """open -> log_hyperparams -> write (every kind of value) -> write_system -> close; a second close is harmless."""
    backend = _backend(cls, tmp_path)
    _open(backend, tmp_path)
    backend.log_hyperparams({"lr": 0.01, "model/depth": 3, "name": "contract"}, "Model.depth = 3\n")
    for step in (0, 1, 2):
        backend.write(_record(step))
    backend.write_system(StepRecord(step=3, scalars={"system/cpu_percent": 12.5, "system/seconds": 3.2}))
    backend.write(StepRecord(step=3))  # an empty commit
    backend.close()
    backend.close()
    assert isinstance(backend.name, str) and backend.name
    assert isinstance(repr(backend), str)


@pytest.mark.parametrize("cls", BACKENDS, ids=_id)
def test_backend_abnormal_exit(cls: Type[Backend], tmp_path):
    """A run that ends abnormally: on_exit(status) once, then close (which still flushes); close again is harmless."""
    backend = _backend(cls, tmp_path)
    _open(backend, tmp_path)
    backend.write(_record(0))
    backend.on_exit("failed")
    backend.close()
    backend.close()


# ------------------------------------------------------------------------------------------------ observers
KINDS = {"scalar": "metrics", "image": "images", "histogram": "histograms", "text": "texts", "video": "videos"}
_KEY_ROW = re.compile(r"^\s*``(?P<key>[^`]+)``\s+(?P<kind>[a-z]+)\b", re.MULTILINE)


def documented_keys(cls: type, name: str) -> Dict[re.Pattern, str]:
    """The keys table of the class docstring as {regex: JSONL section}; ``<name>`` is the observer's name and
    any other ``<placeholder>`` one path component."""
    doc = inspect.getdoc(cls) or ""
    keys: Dict[re.Pattern, str] = {}
    for match in _KEY_ROW.finditer(doc):
        kind = match["kind"]
        if kind not in KINDS:
            continue
        parts = re.split(r"(<[^>]+>)", match["key"])
        pattern = "".join(
            re.escape(name) if part == "<name>" else "[^/]+" if part.startswith("<") else re.escape(part)
            for part in parts
        )
        keys[re.compile(pattern + r"\Z")] = KINDS[kind]
    return keys


def _states(n_iter: int = 4) -> List[torch.Tensor]:
    """A rollout of [2, 5, 6, 6] states (an alpha channel included), deterministic."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 5, 6, 6, generator=g)
    states = [x]
    for _ in range(n_iter):
        x = torch.tanh(x + 0.3 * torch.randn(x.shape, generator=g))
        states.append(x)
    return states


def _watched_rule() -> torch.nn.Module:
    """The module an observer's ``attach`` gets, as if watched: [2, 5, 6, 6] -> same shape, deterministic."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(5, 8, 1), torch.nn.ReLU(), torch.nn.Conv2d(8, 5, 1))


def _read_jsonl(path: Path) -> Dict[int, Dict[str, Any]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return {line["step"]: line for line in lines if "step" in line}


@pytest.mark.parametrize("cls", OBSERVERS, ids=_id)
def test_observer_lifecycle_logs_exactly_its_documented_keys(cls: Type[Observer], tmp_path):
    """reset -> attach([module]) -> observe(StepContext) x n [-> observe_gradients] -> detach -> log(logger, step),
    twice (the module runs each iteration, as a watched one does); the keys staged are the
    ones its docstring documents (each of them, of the documented kind, and nothing else), and reset forgets the
    previous step."""
    observer = build(cls, tmp_path)
    assert isinstance(observer, Observer) and observer.name
    documented = documented_keys(cls, observer.name)
    assert documented, (
        f"{cls.__qualname__}'s docstring has no metric keys table; document every key it emits "
        f"(rows like ``<name>/key``  scalar  meaning)"
    )
    path = tmp_path / "metrics.jsonl"
    logger = Logger([JsonlBackend(path=str(path))], RunInfo("contract", tmp_path))
    states = _states()
    rule = _watched_rule()
    wanted = tuple(observer.probes)  # embedded probes it reads: each gets a tensor of the state's shape
    for step in (0, 1):
        observer.reset()
        observer.attach([rule])  # as if `rule` were watched with inst.watch
        try:
            with torch.no_grad():  # as the dispatcher calls it
                for i in range(len(states) - 1):
                    rule(states[i])  # the watched module runs each iteration: hooks an observer attached see it
                    probes = {name: states[i + 1] * (k + 1) for k, name in enumerate(wanted)}
                    observer.observe(StepContext(states[i], states[i + 1], step_index=i, probes=probes))
                if wanted:  # as if each probe were a gradient probe: one gradient per iteration
                    observer.observe_gradients({name: [s.neg() for s in states[1:]] for name in wanted})
        finally:
            observer.detach()
        assert not rule._forward_hooks and not rule[0]._forward_hooks, "detach() left hooks registered"
        observer.log(logger, step)
        logger.commit(step)
    logger.close()
    assert logger.failures == {}
    lines = _read_jsonl(path)
    assert sorted(lines) == [0, 1]
    staged = {(key, section) for section in KINDS.values() for key in lines[0].get(section, {})}
    assert staged, f"{cls.__qualname__} staged nothing"
    undocumented = sorted(
        f"{key} ({section})" for key, section in staged
        if not any(p.match(key) and s == section for p, s in documented.items())
    )
    assert not undocumented, f"{cls.__qualname__} logs keys its docstring does not document: {undocumented}"
    never = sorted(
        p.pattern.replace("\\", "").removesuffix("Z") for p, s in documented.items()
        if not any(p.match(k) and s == sec for k, sec in staged)
    )
    assert not never, f"{cls.__qualname__} documents keys it did not log: {never}"
    assert all(key.startswith(observer.name + "/") for key, _ in staged)
    for section in KINDS.values():  # the same rollout twice: reset forgot step 0 entirely
        assert _same(lines[0].get(section, {}), lines[1].get(section, {})), section


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# ------------------------------------------------------------------------------------------------ RL components
def _batch(envs: int = 2, steps: int = 4) -> Dict[str, Any]:
    """A small TorchRL-layout batch as nested dicts ([envs, time] batch, trailing singleton on reward/done)."""
    reward = torch.arange(envs * steps, dtype=torch.float32).reshape(envs, steps, 1) / 10
    done = torch.zeros(envs, steps, 1, dtype=torch.bool)
    done[0, 1] = done[1, 3] = True
    mask = torch.ones(envs, steps, dtype=torch.bool)
    mask[1, 0] = False
    return {"next": {"reward": reward, "done": done}, "collector": {"mask": mask}}


def _losses(i: int) -> Dict[str, Any]:
    return {"loss_objective": torch.tensor(0.5 + i), "loss_critic": torch.tensor([0.25, 0.75]), "entropy": 0.1}


def _plain(value: Any, where: str) -> None:
    """state_dict values are plain Python: any checkpoint format can store them."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert isinstance(key, str), f"{where}: key {key!r} is not a str"
            _plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _plain(item, f"{where}[{i}]")
    else:
        assert value is None or isinstance(value, (bool, int, float, str)), (
            f"{where} is a {type(value).__name__}, not a plain Python value"
        )


@pytest.mark.parametrize("cls", RL_COMPONENTS, ids=_id)
def test_rl_component_lifecycle(cls: Type[RLComponent], tmp_path):
    """on_batch / on_losses over an interval -> log(logger, step) under its prefix -> state_dict (plain values) ->
    load_state_dict into a fresh one reproduces it -> close."""
    component = build(cls, tmp_path)
    assert isinstance(component, RLComponent)
    assert component.prefix and not component.prefix.endswith("/"), f"{cls.__qualname__}.prefix {component.prefix!r}"
    path = tmp_path / "metrics.jsonl"
    logger = Logger([JsonlBackend(path=str(path))], RunInfo("contract", tmp_path))
    counters = Counters()
    component.attach(logger)
    for i in range(2):
        component.on_batch(_batch(), frames=None)
        component.on_losses(_losses(i))
        assert isinstance(component.end_iteration(counters), bool)
    component.log(logger, 0)
    logger.commit(0)
    logger.close()
    assert logger.failures == {}
    lines = _read_jsonl(path)
    keys = sorted(k for section in KINDS.values() for k in lines.get(0, {}).get(section, {}))
    if cls.__qualname__ in SILENT_COMPONENTS:
        assert not keys, f"{cls.__qualname__} is listed as logging nothing here but logged {keys}"
    else:
        assert keys, f"{cls.__qualname__} staged nothing from two batches and two loss dicts"
    # logger.timer(...) durations live in the logger's own timing/ namespace (e.g. timing/evaluation).
    outside = [k for k in keys if not k.startswith((component.prefix + "/", "timing/"))]
    assert not outside, f"{cls.__qualname__} logs outside its prefix {component.prefix!r}: {outside}"

    state = component.state_dict()
    assert isinstance(state, dict)
    _plain(state, f"{cls.__qualname__}.state_dict()")
    json.dumps(state)
    fresh = build(cls, tmp_path)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state
    component.close()
    fresh.close()
