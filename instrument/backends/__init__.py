"""One module per destination; each imports its SDK lazily, so importing this package imports none."""

from instrument.backends.base import Backend, PartialWriteError, RunInfo, SampleTable, StepRecord
from instrument.backends.console import ConsoleBackend
from instrument.backends.history import RunHistoryBackend
from instrument.backends.jsonl import JsonlBackend
from instrument.backends.mlflow import MlflowBackend
from instrument.backends.progress import ProgressBar
from instrument.backends.tensorboard import TensorBoardBackend
from instrument.backends.wandb import WandbBackend

__all__ = [
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
]
