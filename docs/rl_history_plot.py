"""Produces docs/rl_history.png: a short TorchRL PPO run on CartPole-v1 kept in a RunHistoryBackend.

Run from the repository root: `python docs/rl_history_plot.py docs/rl_history.png` (about 2 CPU-minutes).
"""

import functools
import sys

import instrument
from instrument.demos.torchrl_ppo import build_ppo_trainer, train_torchrl_ppo
from instrument.rl import Evaluation, RLLogging

history = instrument.RunHistoryBackend()
inst = instrument.Instrumentation(backends=[history], log_interval=1, log_dir="runs")
rl = RLLogging(evaluation=Evaluation(every_frames=2048, max_steps=500), progress=None)
build = functools.partial(build_ppo_trainer, total_frames=12288, frames_per_batch=512, seed=0)
train_torchrl_ppo(instrumentation=inst, rl_logging=rl, build=build)
inst.close()
fig = history.plot_metrics(
    [
        "collection/main/episode/return/mean",
        "eval/deterministic/return",
        "train/main/loss_critic",
        "timing/iteration/mean",
    ],
    title="TorchRL PPO on CartPole-v1 (RunHistoryBackend.plot_metrics)",
)
fig.savefig(sys.argv[1], dpi=90)
for key in ("counters/frames", "collection/main/episode/return/mean", "eval/deterministic/return"):
    print(key, history.last(key))
