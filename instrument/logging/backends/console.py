"""Console: one compact line per committed step, and validation samples as readable panels (rich)."""

import math
import sys
from typing import Optional, Sequence, TextIO

from instrument.errors import require
from instrument.logging.backends.base import Backend, SampleTable, StepRecord
from instrument.logging.samples import select_samples

__all__ = ["ConsoleBackend"]


def _fmt(value: float) -> str:
    if math.isnan(value) or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


class ConsoleBackend(Backend):
    """Prints ``step N | key value | ...`` for each commit.

    Args:
        keys: metric keys (or key prefixes) to show, in order; None shows every scalar, sorted.
        max_keys: at most this many values per line, so a line stays readable.
        stream: where to write; None means ``sys.stdout`` at write time.
        num_val_samples_to_print: how many validation samples (``logger.log_samples``) to print per tag and
            commit, as panels: the best and the worst by score, interleaved. 0 prints none. Needs ``rich``
            (``pip install 'torch-instrument[rich]'``).
        show_system: also print a line per system-monitor sample (``system ... s | ...``).
        width: panel width in characters; None lets rich decide.
    """

    def __init__(
        self,
        keys: Optional[Sequence[str]] = None,
        max_keys: int = 8,
        stream: Optional[TextIO] = None,
        num_val_samples_to_print: int = 4,
        show_system: bool = False,
        width: Optional[int] = None,
    ):
        self.keys = list(keys) if keys is not None else None
        self.max_keys = max_keys
        self.stream = stream
        self.num_val_samples_to_print = int(num_val_samples_to_print)
        self.show_system = show_system
        self.width = width

    def _selected(self, record: StepRecord):
        if self.keys is None:
            items = sorted(record.scalars.items())
        else:
            items = [(k, v) for want in self.keys for k, v in sorted(record.scalars.items())
                     if k == want or k.startswith(want.rstrip("/") + "/")]
        return items[: self.max_keys]

    def write(self, record: StepRecord) -> None:
        parts = [f"step {record.step:>6}"] + [f"{k} {_fmt(v)}" for k, v in self._selected(record)]
        stream = self.stream or sys.stdout
        stream.write(" | ".join(parts) + "\n")
        for tag, table in record.samples.items():
            self._print_samples(stream, tag, table, record.step)
        stream.flush()

    def write_system(self, record: StepRecord) -> None:
        if not self.show_system:
            return
        items = sorted((k, v) for k, v in record.scalars.items() if k != "system/seconds")
        stream = self.stream or sys.stdout
        stream.write(" | ".join([f"system {record.step:>6}s"] + [f"{k} {_fmt(v)}" for k, v in items]) + "\n")
        stream.flush()

    def _print_samples(self, stream: TextIO, tag: str, table: SampleTable, step: int) -> None:
        chosen = select_samples(table.rows, self.num_val_samples_to_print, table.score_key)
        if not chosen:
            return
        require("rich", "rich", "printing validation samples on the console")
        from rich.console import Console
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        console = Console(file=stream, width=self.width, highlight=False, soft_wrap=False)
        for label, row in chosen:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(style="bold", no_wrap=True)
            grid.add_column()
            for field, value in row.items():
                grid.add_row(Text(str(field)), Text(_fmt(value) if isinstance(value, float) else str(value)))
            score = row.get(table.score_key)
            title = f"{tag} | step {step} | {label}"
            if isinstance(score, (int, float)):
                title += f" | {table.score_key} {_fmt(float(score))}"
            console.print(Panel(grid, title=Text(title), title_align="left"))

    def __repr__(self) -> str:
        return (
            f"ConsoleBackend(keys={self.keys!r}, max_keys={self.max_keys}, "
            f"num_val_samples_to_print={self.num_val_samples_to_print})"
        )
