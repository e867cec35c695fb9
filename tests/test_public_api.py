"""The public surface is pinned: ``instrument.__all__`` and each subpackage's ``__all__`` are exactly the lists
below, every name resolves, and every name lives in the subpackage where it belongs.

Changing the public surface is a decision: edit the list here in the same commit, so a review sees it.
(httpx's tests/test_exported_members.py does the same.)
"""

import importlib
import subprocess
import sys
import types

import pytest

import instrument

EXPECTED_ALL = [
    "ActivationStats",
    "Backend",
    "Column",
    "ConfigurationError",
    "ConsoleBackend",
    "CrossRankReducer",
    "GradientStats",
    "InstrumentError",
    "Instrumentation",
    "InvalidValueError",
    "IterationStats",
    "JsonlBackend",
    "Logger",
    "MissingExtraError",
    "MlflowBackend",
    "NonFinite",
    "NonFiniteError",
    "Observer",
    "Probe",
    "ProbeError",
    "RolloutVideo",
    "RunHistoryBackend",
    "RunInfo",
    "RunLog",
    "StateHistogram",
    "StepContext",
    "StepObserver",
    "StepOrderError",
    "StepRecord",
    "StepScope",
    "StepTable",
    "SystemMonitor",
    "TensorBoardBackend",
    "Timer",
    "UpdateNorm",
    "WandbBackend",
    "WatchHandle",
    "__version__",
    "freeze",
    "parse_config",
    "script",
    "setup_run_logging",
]

# Names that another branch of issue 12 adds; until it is merged they are absent here. Each is an xfail(strict)
# below, so once the name has landed that test fails: then delete the entry (the lead does, after merging).
ADDED_BY_OPEN_BRANCHES: dict = {}

# Where each public name lives: its ``__module__`` must be this package or a module inside it.
HOMES = {
    "ActivationStats": "instrument.observers",
    "Backend": "instrument.backends",
    "Column": "instrument.terminal",
    "ConfigurationError": "instrument.errors",
    "ConsoleBackend": "instrument.backends",
    "CrossRankReducer": "instrument.logger",
    "GradientStats": "instrument.observers",
    "InstrumentError": "instrument.errors",
    "InvalidValueError": "instrument.errors",
    "Instrumentation": "instrument.session",
    "IterationStats": "instrument.observers",
    "JsonlBackend": "instrument.backends",
    "Logger": "instrument.logger",
    "MissingExtraError": "instrument.errors",
    "MlflowBackend": "instrument.backends",
    "NonFinite": "instrument.observers",
    "NonFiniteError": "instrument.errors",
    "Observer": "instrument.core",
    "Probe": "instrument.probes",
    "ProbeError": "instrument.errors",
    "RolloutVideo": "instrument.observers",
    "RunHistoryBackend": "instrument.backends",
    "RunInfo": "instrument.backends",
    "RunLog": "instrument.terminal",
    "StateHistogram": "instrument.observers",
    "StepContext": "instrument.core",
    "StepObserver": "instrument.core",
    "StepOrderError": "instrument.errors",
    "StepRecord": "instrument.backends",
    "StepScope": "instrument.session",
    "StepTable": "instrument.terminal",
    "SystemMonitor": "instrument.monitors",
    "TensorBoardBackend": "instrument.backends",
    "Timer": "instrument.logger",
    "UpdateNorm": "instrument.observers",
    "WandbBackend": "instrument.backends",
    "WatchHandle": "instrument.session",
    "freeze": "instrument.probes",
    "parse_config": "instrument.config",
    "script": "instrument.probes",
    "setup_run_logging": "instrument.terminal",
}

SUBPACKAGE_ALL = {
    "instrument.backends": [
        "Backend",
        "ConsoleBackend",
        "JsonlBackend",
        "MlflowBackend",
        "PartialWriteError",
        "ProgressBar",
        "RunHistoryBackend",
        "RunInfo",
        "SampleTable",
        "StepRecord",
        "TensorBoardBackend",
        "WandbBackend",
    ],
    "instrument.core": [
        "Dispatcher",
        "FailureLedger",
        "Observer",
        "RecomputeGuard",
        "StepContext",
        "StepObserver",
        "in_recompute",
    ],
    "instrument.logger": ["CrossRankReducer", "Logger", "Timer"],
    "instrument.observers": [
        "ActivationStats", "GradientStats", "IterationStats", "NonFinite", "RolloutVideo", "StateHistogram",
        "UpdateNorm",
    ],
    "instrument.probes": ["Probe", "freeze"],
    "instrument.terminal": ["Column", "RunLog", "StepTable", "setup_run_logging", "write_line"],
}

# Optional SDKs (pip extras) that importing the package or any subpackage must not import. tqdm is optional for
# us too, but torch itself imports it (torch.hub), so its presence says nothing about instrument.
OPTIONAL_SDKS = ("wandb", "mlflow", "torchrl", "tensordict", "gymnasium", "moviepy", "rich")


def _pending():
    return {name for name in ADDED_BY_OPEN_BRANCHES if name not in instrument.__all__}


def test_the_lists_here_are_sorted_and_consistent():
    assert EXPECTED_ALL == sorted(EXPECTED_ALL)
    assert set(HOMES) == set(EXPECTED_ALL) - {"__version__"}
    assert set(ADDED_BY_OPEN_BRANCHES) <= set(EXPECTED_ALL)
    for names in SUBPACKAGE_ALL.values():
        assert names == sorted(names)


def test_all_is_exactly_the_pinned_list():
    assert len(instrument.__all__) == len(set(instrument.__all__)), "duplicate names in instrument.__all__"
    expected = [name for name in EXPECTED_ALL if name not in _pending()]
    assert sorted(instrument.__all__) == expected, (
        f"instrument.__all__ changed: added {sorted(set(instrument.__all__) - set(expected))}, removed "
        f"{sorted(set(expected) - set(instrument.__all__))}; if that is intended, update EXPECTED_ALL (and HOMES)."
    )


@pytest.mark.parametrize("name", sorted(ADDED_BY_OPEN_BRANCHES))
@pytest.mark.xfail(strict=True, reason="added by another issue-12 branch; delete its ADDED_BY_OPEN_BRANCHES entry "
                                       "once merged")
def test_name_from_an_open_branch_has_landed(name):
    assert name in instrument.__all__, ADDED_BY_OPEN_BRANCHES[name]


def test_every_name_resolves_and_nothing_public_is_missing():
    for name in instrument.__all__:
        assert hasattr(instrument, name), f"instrument.__all__ names {name!r}, which instrument does not define"
    public = {
        n for n, v in vars(instrument).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public <= set(instrument.__all__), f"public but not in __all__: {sorted(public - set(instrument.__all__))}"
    assert isinstance(instrument.__version__, str)


@pytest.mark.parametrize("name", sorted(HOMES))
def test_each_name_lives_in_its_subpackage(name):
    if name in _pending():
        pytest.skip(f"{name} is added by an open branch: {ADDED_BY_OPEN_BRANCHES[name]}")
    home = HOMES[name]
    module = getattr(instrument, name).__module__
    assert module == home or module.startswith(home + "."), f"instrument.{name} is defined in {module}, not {home}"


@pytest.mark.parametrize("package", sorted(SUBPACKAGE_ALL))
def test_subpackage_all_is_pinned_and_its_names_live_there(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == SUBPACKAGE_ALL[package], f"{package}.__all__ changed; update SUBPACKAGE_ALL"
    for name in module.__all__:
        value = getattr(module, name)
        home = value.__module__
        assert home.startswith(package + "."), f"{package}.{name} is defined in {home}, outside {package}"
        if name in instrument.__all__:
            assert getattr(instrument, name) is value, f"instrument.{name} is not {package}.{name}"


def test_names_exported_by_both_are_homed_in_that_subpackage():
    """A name a subpackage re-exports and ``instrument`` exports has the same home in both lists."""
    for package, names in SUBPACKAGE_ALL.items():
        for name in set(names) & set(HOMES):
            assert HOMES[name] == package, (name, HOMES[name], package)


def test_importing_the_package_and_its_subpackages_imports_no_optional_sdk():
    code = (
        "import sys, instrument\n"
        + "".join(f"import {package}\n" for package in sorted(SUBPACKAGE_ALL))
        + f"print(sorted(m for m in {OPTIONAL_SDKS!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"imported optional SDKs: {result.stdout.strip()}"


def test_the_observer_signatures_in_the_docs_are_the_real_ones():
    """docs/observers.md's headers left out ``max_elements`` of IterationStats and UpdateNorm, which sits before
    ``color_range`` / ``channel_dim``: `UpdateNorm("u", 3, 0.1, 1)` as read there binds max_elements=1. Each
    header must list the constructor's parameters in their order, with their defaults (names: the default)."""
    import ast
    import inspect
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "observers.md").read_text()
    headers = re.findall(r"^### `(\w+)\((.*)\)`$", text, flags=re.M)
    assert len(headers) >= 7
    for cls_name, args in headers:
        cls = getattr(instrument, cls_name)
        call = ast.parse(f"f({args})").body[0].value
        documented = {kw.arg: ast.literal_eval(kw.value) if not isinstance(kw.value, ast.BinOp) else eval(
            compile(ast.Expression(kw.value), "<doc>", "eval")) for kw in call.keywords}
        params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
        assert list(documented) == [p.name for p in params], cls_name
        for p in params:
            want = getattr(cls, "default_name", "") if p.name == "name" else p.default
            assert documented[p.name] == want, (cls_name, p.name, documented[p.name], want)
