"""A checkpoint saved inside an iteration whose end runs a due evaluation: the resumed run goes on with the
evaluation schedule and seeds of the run that was never interrupted, read back from JSONL."""

import json

import numpy as np
import torch

import instrument
from instrument.rl import CollectionMetrics, Evaluation, GymnasiumRunner, RLLogging
from tests.test_rl_state import run_and_resume

T, N, INTERVAL, ITERATIONS = 4, 2, 5, 12  # 8 frames an iteration: evaluations due at iterations 2, 5, 8, 11


class _SeedEnv:
    """One-step episodes whose return is the reset seed: the logged return names the seed the evaluation used."""

    class action_space:
        n = 2

    def reset(self, seed=None):
        self.seed = seed
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(2, dtype=np.float32), float(self.seed), True, False, {}

    def close(self):
        pass


def _session(folder, resume=False):
    inst = instrument.Instrumentation(backends=[instrument.JsonlBackend()], log_interval=INTERVAL, log_dir=str(folder),
                                      run_name="r", resume=resume, overhead_budget=None)
    runner = GymnasiumRunner(lambda: _SeedEnv(), torch.nn.Linear(2, 2), seed=100)
    rl = RLLogging(collection=CollectionMetrics(time_dim=0), progress=None,
                   evaluation=Evaluation(every_frames=3 * T * N, max_steps=3)).attach(inst, eval_runner=runner)
    return inst, rl


def _iterate(inst, rl, iteration, save=False):
    g = torch.Generator().manual_seed(iteration)
    with inst.step(iteration), rl.iteration():
        reward = torch.rand(T, N, generator=g, dtype=torch.float64)
        rl.observe_batch(reward=reward, done=torch.ones(T, N, dtype=torch.bool))
        return rl.state_dict() if save else None


def _evaluations(folder):
    lines = [json.loads(line) for line in (folder / "r" / "metrics.jsonl").read_text().splitlines()]
    return [(x["step"], {k: v for k, v in x["metrics"].items() if k.startswith(("eval/", "counters/"))})
            for x in lines if "step" in x and any(k.startswith("eval/") for k in x["metrics"])]


def test_a_checkpoint_inside_an_iteration_that_evaluates_resumes_without_evaluating_again(tmp_path):
    """Saved inside iteration 5 (a logging step with an evaluation due), the state counted the iteration as done
    but kept the schedule from before its evaluation: the resumed run evaluated again at step 6, a step the
    uninterrupted run never logged, with the seeds step 5 had used, and the interval's values moved to it."""
    run_and_resume(tmp_path, _session, _iterate, ITERATIONS, save_at=5)  # iterations 6 and 7 lost
    expected = _evaluations(tmp_path / "a")
    assert [step for step, _ in expected] == [2, 5, 8, 11]
    assert _evaluations(tmp_path / "b") == expected  # the same steps, the same seeds (returns)


def test_a_due_evaluation_that_waited_is_saved_as_run_at_the_frames_it_runs_at():
    """Under a process group a due evaluation waits for a logging iteration, whose `end_iteration` re-reads the
    frames: saved inside that iteration, the schedule was taken from the frames it first fell due at (120), so the
    resumed run was due again at 200 when the uninterrupted run waited for 400 (a review)."""
    from types import SimpleNamespace

    evaluation = Evaluation(every_frames=100, max_steps=1)
    evaluation.end_iteration(SimpleNamespace(frames=120))  # due at an iteration that does not log: it waits
    at = evaluation.runs_at(350)
    assert at == 350 and evaluation.state_after_run(at)["next_due"] == 400
    evaluation.end_iteration(SimpleNamespace(frames=350))
    assert evaluation._due_at == 350  # what the run at that iteration's end schedules from: 400
