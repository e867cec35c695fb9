"""The progress bar closes on the writer thread, behind the records committed before `RLLogging.close`: its
last line shows the run's final frame count, also when a slow backend keeps records queued at the close."""

import io
import json
import time

import torch

import instrument
from instrument.backends.base import Backend
from instrument.rl import ProgressBar, RLLogging
from instrument.rl.collection import CollectionMetrics


class SlowBackend(Backend):
    """A backend that takes a while to write (a remote tracker): records stay queued behind it."""

    def write(self, record):
        time.sleep(0.05)


def test_the_bar_ends_on_the_final_count_committed_by_close(tmp_path):
    stream = io.StringIO()
    bar = ProgressBar(enabled=True, stream=stream, total_frames=250)
    inst = instrument.Instrumentation(backends=[SlowBackend(), instrument.JsonlBackend()], log_interval=10,
                                      log_dir=str(tmp_path), run_name="r", overhead_budget=None)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=bar).attach(inst)
    for it in range(25):
        with inst.step(it), rl.iteration():
            rl.observe_batch(reward=torch.ones(5, 2), done=torch.zeros(5, 2, dtype=torch.bool))
    rl.close()  # commits iterations 21..24 at step 24, then closes the bar
    assert bar.bar is None  # closed by the time close returns
    inst.close()
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    frames = [(line["step"], line["metrics"]["counters/frames"]) for line in lines if "step" in line]
    assert frames[-1] == (24, 250)
    final = stream.getvalue().replace("\n", "\r").split("\r")
    final = [line for line in final if line.strip()][-1]
    assert "250/250" in final and "100%" in final, final
