"""TorchRL end to end: a real Collector over gymnasium CartPole-v1 and a real Trainer running a short PPO,
metrics read back from TensorBoard; a trainer resumed from its state_dict continues the step numbering."""

import pytest

pytest.importorskip("torchrl")

import instrument  # noqa: E402
from instrument import config  # noqa: E402
from instrument.rl import CollectionMetrics, Evaluation, RLLogging  # noqa: E402
from tests.conftest import event_accumulator  # noqa: E402


def steps_of(acc, tag):
    return [e.step for e in acc.Scalars(tag)]


def test_gin_bound_ppo_logs_every_family_through_the_trainer_hooks(tmp_path):
    instrument.parse_config(
        ["rl_torchrl_ppo"],
        [
            "build_ppo_trainer.total_frames = 256",
            "build_ppo_trainer.frames_per_batch = 128",
            "build_ppo_trainer.epochs = 1",
            "Evaluation.every_frames = 256",
            "Evaluation.max_steps = 50",
            f"Instrumentation.log_dir = '{tmp_path}'",
            "backend_set.console = None",
        ],
    )
    outcome = config.run()
    assert outcome["result"] == {"frames": 256, "episodes": outcome["result"]["episodes"], "iterations": 2}
    acc = event_accumulator(outcome["run_dir"])
    tags = set(acc.Tags()["scalars"])
    for key in (
        "collection/main/reward/mean",
        "collection/main/episode/return/mean",
        "collection/main/episode/count",
        "counters/frames",
        "counters/episodes",
        "train/main/loss_objective",
        "train/main/loss_critic",
        "eval/deterministic/return",
        "eval/stochastic/length",
        "timing/collection/mean",
        "timing/optimization/mean",
        "timing/iteration/mean",
        "timing/evaluation/mean",
    ):
        assert key in tags, key
    assert steps_of(acc, "counters/frames") == [0, 1]
    assert [e.value for e in acc.Scalars("counters/frames")] == [128.0, 256.0]
    assert steps_of(acc, "eval/deterministic/return") == [1]  # at 256 frames
    episodes = sum(e.value for e in acc.Scalars("collection/main/episode/count"))
    assert episodes == acc.Scalars("counters/episodes")[-1].value == outcome["result"]["episodes"] > 0
    returns = [e.value for e in acc.Scalars("collection/main/episode/return/mean")]
    assert all(8 <= r <= 500 for r in returns)  # CartPole episodes last 8+ steps, reward 1 per step


def test_trainer_state_dict_resumes_counters_and_steps(tmp_path):
    from instrument.demos.torchrl_ppo import build_ppo_trainer, run_trainer

    def session(resume):
        return instrument.Instrumentation(
            backends=[instrument.TensorBoardBackend()], log_interval=1, log_dir=str(tmp_path), run_name="ppo",
            resume=resume,
        )

    checkpoint = str(tmp_path / "trainer.pt")

    def build(total):
        rl = RLLogging(collection=CollectionMetrics(group="cartpole"), progress=None)
        return build_ppo_trainer(
            instrumentation=session(resume=total > 128),  # the second one continues the first run
            rl_logging=rl,
            total_frames=total,
            frames_per_batch=64,
            epochs=1,
            seed=1,
            save_trainer_file=checkpoint,
        )

    first, first_hook = build(128)
    run_trainer(
        first
    )  # TorchRL saves the trainer, our hook's state_dict included, when it reaches total_frames
    second, hook = build(256)
    second.load_from_file(checkpoint)
    assert hook.rl.counters.iterations == 2 and hook.rl.counters.frames == 128
    run_trainer(second)
    acc = event_accumulator(tmp_path / "ppo")
    assert steps_of(acc, "counters/frames") == [0, 1, 2, 3]  # each step once, the resumed run goes on at 2
    assert [e.value for e in acc.Scalars("counters/frames")] == [64.0, 128.0, 192.0, 256.0]
    assert [e.value for e in acc.Scalars("counters/iterations")] == [1.0, 2.0, 3.0, 4.0]
    assert "collection/cartpole/episode/return/mean" in acc.Tags()["scalars"]
    assert first_hook.rl.evaluation is None and isinstance(hook, type(first_hook))


def test_the_hook_is_a_torchrl_trainer_hook():
    from torchrl.trainers import TrainerHookBase

    from instrument.rl.torchrl import TorchRLHook

    hook = config.torchrl_hook(rl=RLLogging(progress=None, evaluation=Evaluation()))
    assert isinstance(hook, TorchRLHook) and isinstance(hook, TrainerHookBase)


def test_a_replay_buffer_that_flattens_the_batch_does_not_cut_episodes_across_environments(tmp_path):
    """ReplayBufferTrainer(flatten_tensordicts=True), the DQN/SAC recipe, hands the later hooks a flattened
    [N * T] batch: episodes were cut across environments (a first return of 116 for an episode of 36). The
    reference is summed per environment from the collector's own [N, T] batches, read back from JSONL."""
    import json
    import math
    import warnings

    import torch
    from torch import nn
    from torchrl.collectors import Collector
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from torchrl.envs import GymEnv, SerialEnv
    from torchrl.modules import QValueActor
    from torchrl.objectives import DQNLoss
    from torchrl.trainers import ReplayBufferTrainer, Trainer

    from instrument.rl.torchrl import TorchRLHook

    warnings.simplefilter("ignore")  # torchrl's own deprecation and setup warnings
    torch.manual_seed(0)
    envs, horizon, total = 3, 40, 480
    env = SerialEnv(envs, lambda: GymEnv("CartPole-v1", categorical_action_encoding=True))
    env.set_seed(0)
    actor = QValueActor(nn.Linear(4, 2), in_keys=["observation"], spec=env.action_spec_unbatched)
    collector = Collector(env, actor, frames_per_batch=envs * horizon, total_frames=total)
    loss = DQNLoss(actor, action_space=env.action_spec_unbatched)
    trainer = Trainer(collector=collector, total_frames=total, frame_skip=1, optim_steps_per_batch=1,
                      loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), 1e-3), progress_bar=False,
                      auto_log_optim_steps=False)
    reference, carry = [], [[0.0, 0] for _ in range(envs)]

    def record(batch):
        rewards, done = batch["next", "reward"][..., 0].double(), batch["next", "done"][..., 0]
        episodes = []
        for n in range(rewards.shape[0]):
            for t in range(rewards.shape[1]):
                carry[n][0] += float(rewards[n, t])
                carry[n][1] += 1
                if done[n, t]:
                    episodes.append(tuple(carry[n]))
                    carry[n] = [0.0, 0]
        reference.append(episodes)

    trainer.register_op("batch_process", record)
    ReplayBufferTrainer(ReplayBuffer(storage=LazyTensorStorage(10_000)), batch_size=32,
                        flatten_tensordicts=True).register(trainer)
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend(str(path))], log_interval=1,
                                      log_dir=str(tmp_path))
    TorchRLHook(RLLogging(progress=None), instrumentation=inst, close_on_shutdown=False).register(trainer)
    trainer.train()
    inst.close()
    logged = {r["step"]: r["metrics"] for r in map(json.loads, path.read_text().splitlines()) if "metrics" in r}
    assert len(reference) == total // (envs * horizon) and sum(map(len, reference)) >= 4
    for step, episodes in enumerate(reference):
        got = logged[step]
        assert got["collection/main/episode/count"] == len(episodes)
        if episodes:
            assert got["collection/main/episode/return/mean"] == pytest.approx(
                math.fsum(e[0] for e in episodes) / len(episodes), rel=1e-12)
            assert got["collection/main/episode/length/max"] == max(e[1] for e in episodes)


def test_a_batched_eval_env_measures_each_environments_whole_first_episode():
    """With a batched eval env the rollout stopped at the first done, so the other environments' unfinished
    episodes were averaged in as if they had ended (return 25 where the episodes lasted 32, 26 and 25). The
    reference: each environment's first episode, summed in a Python loop over the same seeded rollout."""
    import warnings

    import torch
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torchrl.envs import GymEnv, SerialEnv

    from instrument.rl.torchrl import TorchRLRunner

    class Lean(nn.Module):  # pushes towards the pole's lean: fails after 25-35 steps, differently per start
        def forward(self, observation):
            return (observation[..., 2] > 0).to(torch.int64)

    warnings.simplefilter("ignore")  # torchrl's own setup warnings
    env = SerialEnv(3, lambda: GymEnv("CartPole-v1", categorical_action_encoding=True))
    policy = TensorDictModule(Lean(), in_keys=["observation"], out_keys=["action"])
    env.set_seed(0)
    episode = TorchRLRunner(env, policy)(True, 500, False)
    env.set_seed(0)
    rollout = env.rollout(500, policy, break_when_any_done=False, break_when_all_done=True)
    rewards, done = rollout["next", "reward"][..., 0].double(), rollout["next", "done"][..., 0]
    returns, lengths = [], []
    for n in range(rewards.shape[0]):
        total, steps = 0.0, 0
        for t in range(rewards.shape[1]):
            total, steps = total + float(rewards[n, t]), steps + 1
            if done[n, t]:
                break
        returns.append(total)
        lengths.append(steps)
    env.close()
    assert len(set(lengths)) > 1  # the environments' episodes end at different steps
    assert float(episode.return_) == pytest.approx(sum(returns) / len(returns), rel=1e-6)
    assert float(episode.length) == pytest.approx(sum(lengths) / len(lengths), rel=1e-6)
