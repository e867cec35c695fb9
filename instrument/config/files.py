"""The config files: where the shipped ones live, how a name or a path finds one, and the errors about them.

A config is a shipped config's name (``nca``, ``backends/wandb``) or a path to a ``.gin`` file. The errors
carry where the problem is, the statement, the problem and a fix, so the CLI prints them in a few lines.
"""

import difflib
import re
from pathlib import Path
from typing import List

from instrument.errors import ConfigurationError

__all__ = ["CONFIG_DIR", "AmbiguousNameError", "ConfigFileError", "ConfigImportError", "ConfigSyntaxError",
           "ConfigTypeError", "GinConfigError", "ShippedConfig", "read_text", "resolve_config", "shipped_configs",
           "shown"]

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


class GinConfigError(ConfigurationError):
    """A bad ``.gin`` file or binding: ``where`` it is, the ``statement``, the ``problem`` and a ``fix``."""

    def __init__(self, problem: str, where: str = "", statement: str = "", fix: str = "") -> None:
        self.problem, self.where, self.statement, self.fix = problem, where, statement, fix
        lines = [f"{where}: {problem}" if where else problem]
        if statement:
            lines.append(f"    {statement}")
        if fix:
            lines.append(f"  fix: {fix}")
        self.message = "\n".join(lines)
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class ConfigFileError(GinConfigError, FileNotFoundError):
    """A config file or an ``include`` that exists neither as a path nor as a shipped config."""


class ConfigSyntaxError(GinConfigError, SyntaxError):
    """A line gin cannot parse."""


class ConfigImportError(GinConfigError, ImportError):
    """An ``import`` line naming a module that cannot be imported."""


class ConfigTypeError(GinConfigError, TypeError):
    """A bound literal of a type its parameter's annotation rules out (``steps = 'ten'`` for ``steps: int``)."""


class AmbiguousNameError(GinConfigError, KeyError):
    """A short name that several registered configurables share (gin raises a KeyError for it)."""


class ShippedConfig:
    """One file of ``instrument/configs``: its ``name`` (``nca``, ``backends/tensorboard``), path, description."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.name = path.relative_to(CONFIG_DIR).with_suffix("").as_posix()
        text = path.read_text(encoding="utf-8")
        first = next((line for line in text.splitlines() if line.startswith("#")), "#")
        self.description = first.lstrip("#").strip().split(". ", 1)[0].rstrip(".") + "."
        self.binds_experiment = re.search(r"^(?:instrument\.)?run\.experiment\s*=", text, re.M) is not None
        self.includes = re.findall(r"^include\s+['\"]([^'\"]+)\.gin['\"]", text, re.M)
        self.runnable = self.binds_experiment

    def __repr__(self) -> str:
        return f"ShippedConfig({self.name!r})"


def shipped_configs() -> List[ShippedConfig]:
    """The shipped configs: runnable experiments first, then the fragments meant to be included."""
    found = [ShippedConfig(p) for p in sorted(CONFIG_DIR.rglob("*.gin"))]
    by_name = {c.name: c for c in found}
    for _ in found:  # runnable: binds run.experiment itself or includes a shipped config that does
        for c in found:
            c.runnable = c.runnable or any(by_name[i].runnable for i in c.includes if i in by_name)
    return sorted(found, key=lambda c: (not c.runnable, "/" in c.name, c.name))


def resolve_config(name_or_path: str) -> Path:
    """A path to a ``.gin`` file as given, else the shipped config of that name (``nca`` or ``nca.gin``)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    shipped = CONFIG_DIR / (name_or_path if name_or_path.endswith(".gin") else f"{name_or_path}.gin")
    if shipped.is_file() and not Path(name_or_path).is_absolute():
        return shipped
    names = [c.name for c in shipped_configs() if c.runnable]
    if path.is_dir():
        raise ConfigFileError(
            f"{name_or_path!r} is a directory; expected a .gin file (or the name of a shipped config).",
            fix=f"give the .gin file inside it, or a shipped config: {', '.join(names)}.",
        )
    close = difflib.get_close_matches(Path(name_or_path).stem, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    where = "" if path.is_absolute() else f" (looked in {Path.cwd()})"
    raise ConfigFileError(
        f"no config file {name_or_path!r}{where} and no shipped config of that name.",
        fix=f"{hint}give a path to a .gin file, or a shipped config: {', '.join(names)} "
        f"(`instrument list` describes them).",
    )


def read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8-sig", errors="replace")  # a BOM is no part of line 1
    except OSError:
        return ""


def shown(path: str) -> str:
    """A config file's name in a message: as gin names it (the path given, an included file's joined to the
    including file's folder: ``sub/inner.gin``), a shipped one as ``include`` names it (``backends/wandb.gin``)."""
    try:
        return Path(path).relative_to(CONFIG_DIR).as_posix() if Path(path).is_absolute() else path
    except ValueError:
        return path
