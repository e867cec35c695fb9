"""The docs' recipe for reading metrics.jsonl with pandas (docs/backends.md, JSONL), run as written.

``pd.read_json(lines=True)``, the obvious way, rounds floats, leaves a NaN column as strings and turns the
steps into float64 once a hyperparameters or system line is present: the recipe must give back every step
and every float bit for bit.
"""

import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

import instrument
from instrument.backends.base import StepRecord

DOCS = Path(__file__).resolve().parents[1] / "docs" / "backends.md"


def _recipe() -> str:
    text = DOCS.read_text(encoding="utf-8")
    section = text[text.index("**Reading it with pandas.**"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_pandas_recipe_reads_back_every_step_and_float_exactly(tmp_path):
    pytest.importorskip("pandas")
    jsonl = instrument.JsonlBackend()
    inst = instrument.Instrumentation(backends=[jsonl], log_interval=1, log_dir=str(tmp_path), run_name="pd",
                                      hyperparams={"lr": 0.1}, overhead_budget=None)
    rng = random.Random(1)
    steps = [0, 1, 2, 3, 2**53 + 1]
    logged = {"loss": [rng.random() for _ in steps], "acc": [math.nan, math.inf, -math.inf, 0.1 + 0.2, 1e-300]}
    for i, step in enumerate(steps):
        inst.logger.log_metrics({key: values[i] for key, values in logged.items()}, step=step, commit=True)
        if i == 1:
            inst.logger.write_system(StepRecord(step=1, scalars={"system/cpu": 5.0}))
    inst.close()
    lines = Path(jsonl.path).read_text().splitlines()
    assert any('"hyperparameters"' in line for line in lines) and any('"system_step"' in line for line in lines)

    namespace = {"path": jsonl.path}
    exec(_recipe(), namespace)  # noqa: S102 - the documented block, as a user would paste it
    df = namespace["df"]
    assert df.index.dtype == np.int64 and list(df.index) == steps
    for key, values in logged.items():
        reference = np.array(values, dtype=np.float64)
        assert df[key].dtype == np.float64
        np.testing.assert_array_equal(df[key].to_numpy(), reference)  # NaN matches NaN; every bit else
        assert df[key].to_numpy().tobytes() == reference.tobytes()
