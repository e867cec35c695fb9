"""The peer rows' W&B run: ``wandb.watch`` and offline ``wandb.log``, timed in a group of their own."""

import contextlib
import os
from typing import List

from torch import nn

from bench.scalar_rows import finish_scalar_rows

__all__ = ["WANDB_GROUP", "finish_peers", "wandb_run", "wandb_variant"]

_WANDB_RUNS: List[object] = []
# The W&B peer rows are timed in an interleaved group of their own after the rest (`Variant.group`), their
# baselines timed again beside them. wandb hands its data to its service as protobuf messages, and protobuf's
# C implementation calls glibc's malloc_trim(0) after every 10,000 freed messages: the whole free heap goes
# back to the kernel, about once per wandb.watch call of the RL row. Interleaved with the rest, every row run
# after one faulted its memory in again (nca/compile/probe-log about 9,800 page faults per step, 0 without
# the W&B rows): a cost of wandb, charged to rows that do not use it.
WANDB_GROUP = "wandb"


def wandb_run(tmp: str):
    """(run, None): the one offline W&B run every peer row logs to; (None, why) when wandb cannot be used.

    One run for the whole session: wandb.watch's hooks log through the global ``wandb.run``.
    """
    try:
        import wandb
    except ImportError:
        return None, "skipped: wandb is not importable (pip install 'torch-instrument[wandb]')"
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("WANDB_MODE", "offline")
    if not _WANDB_RUNS:
        _WANDB_RUNS.append(wandb.init(mode="offline", dir=tmp, project="instrument-bench", name="peers"))
    return _WANDB_RUNS[0], None


def wandb_variant(model: nn.Module, workload: str, tmp: str, make_train):
    """``wandb.watch(model, log="all", log_freq=1)`` in offline mode, plus ``wandb.log`` of the loss."""
    run, problem = wandb_run(tmp)
    if run is None:
        return None, problem, ""
    run.watch(model, log="all", log_freq=1)
    train = make_train(model)

    def fn():
        loss = train()
        run.log({f"{workload}/loss": loss.item()})

    describe = 'wandb.watch(model, log="all", log_freq=1), offline'
    if workload == "rl":
        describe += "; the policy runs every env step, so watch logs per call"
    return fn, None, describe


def finish_peers() -> None:
    """Close what the rows opened, after the measurement: the scalar rows' writers, then the W&B run."""
    finish_scalar_rows()
    while _WANDB_RUNS:
        run = _WANDB_RUNS.pop()
        with contextlib.suppress(Exception):
            run.finish(quiet=True)
