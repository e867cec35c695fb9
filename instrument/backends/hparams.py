"""Hyperparameters as people read them: nested for tree views (W&B), ordered for tables (TensorBoard).

The logger hands backends flat, redacted names (``optim/lr``, ``Model.depth``, ``train/Adam.lr``); this
module turns them back into what each destination shows best.
"""

import re
from typing import Any, Dict, List, Mapping, Sequence, Tuple

__all__ = ["hyperparameter_table", "order_params", "split_name", "unflatten_params"]


def split_name(name: str) -> List[str]:
    """``"train/Adam.lr"`` -> ``["train", "Adam", "lr"]``: the parts of a flat name (``/`` and ``.`` separate)."""
    return [part for part in re.split(r"[/.]", name) if part] or [name]


def unflatten_params(flat: Mapping[str, Any]) -> Dict[str, Any]:
    """Nest flat names for backends with a tree view (W&B's config): ``a/b`` and ``Configurable.param`` nest.

    ``{"optim/lr": 1e-3, "Model.depth": 3}`` -> ``{"optim": {"lr": 1e-3}, "Model": {"depth": 3}}``. A name
    that would land on an existing leaf, or whose own place already holds a subtree (``"a": 1`` next to
    ``"a/b": 2``), is kept whole at the top level instead, so no value is lost or overwritten.
    """
    nested: Dict[str, Any] = {}
    clashes: Dict[str, Any] = {}
    for name, value in flat.items():
        parts = split_name(str(name))
        node = nested
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                node = None
                break
            node = child
        if node is None or parts[-1] in node:
            clashes[str(name)] = value
            continue
        node[parts[-1]] = value
    for name, value in clashes.items():  # "a" beside a subtree "a": kept as "a/" (then "a//", ...)
        while name in nested:
            name += "/"
        nested[name] = value
    return nested


# Parameter name parts that mark a training setting (shown first) or backend plumbing (shown last).
_TRAINING = {"lr", "learning", "rate", "steps", "step", "seed", "seeds", "batch", "epochs", "epoch", "iterations",
             "optimizer", "optim", "weight_decay", "momentum", "gamma", "num_steps", "total_timesteps"}
_PLUMBING = {"backend", "backends", "backend_set", "wandb", "mlflow", "tensorboard", "console", "jsonl", "history",
             "progress", "log_dir", "run_name", "flush_secs", "queue_size", "on_full", "project", "entity",
             "tracking_uri", "experiment", "run_log", "system_monitor", "logger", "dir", "mode", "tags", "notes",
             "on_step_regression", "Instrumentation", "ConsoleBackend", "WandbBackend", "MLflowBackend",
             "TensorBoardBackend", "JsonlBackend", "ProgressBar", "SystemMonitor"}


def order_params(names: Sequence[str]) -> List[str]:
    """Names in reading order: training settings (learning rate, steps, seeds...) first, then the model and
    everything else, then backend plumbing (log dirs, W&B/MLflow settings); alphabetical within each group."""

    def rank(name: str) -> Tuple[int, str]:
        parts = split_name(name)
        words = set(parts) | {w for p in parts for w in p.lower().split("_")}
        if words & _PLUMBING or any(p in _PLUMBING for p in parts):
            return (2, name.lower())
        if words & _TRAINING or any(w.startswith(("lr", "seed", "learning_rate")) for w in parts):
            return (0, name.lower())
        return (1, name.lower())

    return sorted(names, key=rank)


def hyperparameter_table(params: Mapping[str, Any]) -> str:
    """A markdown table of the hyperparameters: training settings first, backend plumbing last.

    A flat name ``section/Configurable.param`` is shown as two cells, where (``section/Configurable``) and
    what (``param``), so a narrow column wraps between them, never inside a name.
    """
    rows = []
    for name in order_params(list(params)):
        where, _, leaf = _split_last(name)
        rows.append(f"| {_cell(where)} | {_cell(leaf)} | {_cell(str(params[name]))} |")
    return "| where | parameter | value |\n|---|---|---|\n" + "\n".join(rows)


def _cell(text: str) -> str:
    """A markdown table cell: ``\\`` and ``|`` escaped (the backslash first: ``cat\\|dog`` or a cell ending in ``\\``
    would cancel the pipe's escape and split the row) and line breaks as spaces, in names and values alike (a name's
    ``|`` made a cell of its own, a newline broke the table). Display only: the hparams keep the names as given."""
    text = text.replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def _split_last(name: str):
    cut = max(name.rfind("/"), name.rfind("."))
    return (name[:cut], name[cut], name[cut + 1 :]) if cut > 0 else ("", "", name)
