"""Counters and resume: a run resumed from state_dict continues counting and logs every step exactly once."""

import json

import pytest
import torch

import instrument
from instrument import ConfigurationError, Logger
from instrument.rl import CollectionMetrics, Counters, RLLogging

TensorDict = pytest.importorskip("tensordict").TensorDict  # the 'torchrl' extra


def batch(t: int = 4, envs: int = 2, done_at=((0, 1),), mask=None):
    done = torch.zeros(envs, t, 1, dtype=torch.bool)
    for e, s in done_at:
        done[e, s] = True
    data = {"next": {"reward": torch.ones(envs, t, 1), "done": done}}
    if mask is not None:
        data["collector"] = {"mask": mask}
    return TensorDict(data, batch_size=[envs, t]).refine_names(None, "time")


def test_frames_with_frame_skip_mask_and_episodes():
    counters = Counters(frame_skip=4)
    counters.on_batch(batch())
    assert counters.frames_known and counters.frames == 32
    counters.on_batch(
        batch(
            mask=torch.tensor([[True, True, False, False], [True, False, False, False]]),
            done_at=((0, 1), (1, 3)),
        )
    )
    assert not counters.frames_known  # the mask sum is still on the device
    assert counters.frames == 32 + 3 * 4
    assert counters.episodes == 2  # (1, 3) is a padded step
    counters.on_batch(frames=100, done=torch.tensor([True, False, True]))
    counters.end_iteration()
    assert counters.state_dict() == {"frames": 44 + 100, "iterations": 1, "episodes": 4}


def test_counters_are_logged_as_exact_floats():
    counters = Counters()
    counters.load_state_dict({"frames": 2**30 + 1, "iterations": 3, "episodes": 5})
    counters.on_batch(batch(mask=torch.ones(2, 4, dtype=torch.bool)))
    logger = Logger([])
    counters.log(logger, 0)
    assert logger.commit(0).scalars["counters/frames"] == 2**30 + 1 + 8  # float32 would round this


def test_bad_counter_input():
    with pytest.raises(ConfigurationError, match="cannot tell how many frames"):
        Counters().on_batch({"next": {"reward": torch.ones(3)}})
    with pytest.raises(ConfigurationError, match="frame_skip must be a positive int"):
        Counters(frame_skip=0)
    with pytest.raises(ConfigurationError, match=r"the state lacks \['episodes'\]"):
        Counters().load_state_dict({"frames": 1, "iterations": 1})


def run_iterations(rl: RLLogging, n: int) -> None:
    for _ in range(n):
        with rl.iteration():
            rl.observe_batch(batch())
            rl.observe_losses({"loss": torch.tensor(float(rl.iteration_index))})


def jsonl_steps(path):
    return [json.loads(line) for line in open(path) if '"step"' in line]


def test_resume_from_state_dict_continues_steps_exactly(tmp_path):
    # One run of 7 iterations, logging every 2nd ...
    straight = Logger([instrument.JsonlBackend(str(tmp_path / "straight.jsonl"))])
    rl = RLLogging(log_interval=2, progress=None).attach(straight)
    run_iterations(rl, 7)
    rl.close()
    straight.close()
    # ... against 3 iterations, a checkpoint, and a fresh process-like restart writing to the same file.
    path = str(tmp_path / "resumed.jsonl")
    first = Logger([instrument.JsonlBackend(path)])
    rl1 = RLLogging(log_interval=2, progress=None).attach(first)
    run_iterations(rl1, 3)
    state = json.loads(json.dumps(rl1.state_dict()))  # plain values: survives any checkpoint format
    rl1.close()
    first.close()
    second = Logger([instrument.JsonlBackend(path)])
    rl2 = RLLogging(log_interval=2, progress=None).attach(second)
    rl2.load_state_dict(state)
    run_iterations(rl2, 4)
    rl2.close()
    second.close()

    def strip(
        rows,
    ):  # the counters are what a resume guarantees; interval statistics restart with the process
        return [
            (r["step"], {k: v for k, v in r["metrics"].items() if k.startswith("counters/")}) for r in rows
        ]

    resumed = strip(jsonl_steps(path))
    assert [s for s, _ in resumed] == [0, 2, 4, 6]  # every step once, none re-logged
    assert resumed == strip(jsonl_steps(tmp_path / "straight.jsonl"))
    assert resumed[-1][1] == {"counters/frames": 7 * 8, "counters/iterations": 7, "counters/episodes": 7}


@pytest.mark.parametrize("step_unit, committed, resumes_after", [("iterations", 3, 0), ("frames", 32, 8)])
def test_loading_an_older_state_into_a_live_logger_is_refused_at_the_load_and_changes_nothing(
        step_unit, committed, resumes_after):
    """On a bare Logger the load went through and rolled the counters back: the next iteration then failed to
    commit (StepOrderError, its components' values reported and dropped), or, counting frames, its values were
    held back until the frame count passed the logger's step. Refused at the load now, as attached to a session
    (tests/test_rl_state.py); the run goes on where it was."""
    logger = Logger([])
    rl = RLLogging(log_interval=1, progress=None, step_unit=step_unit).attach(logger)
    run_iterations(rl, 1)
    early = rl.state_dict()
    run_iterations(rl, 3)
    now = rl.state_dict()
    assert logger.last_step == committed
    with pytest.raises(ConfigurationError, match=rf"this logger has already committed step {committed}, but the "
                       rf"state resumes after step {resumes_after} \({step_unit}\).*nothing was loaded"):
        rl.load_state_dict(early)  # going back in time on the same logger would re-log its steps
    assert rl.state_dict() == now
    run_iterations(rl, 1)  # the run goes on where it was
    assert logger.last_step == (4 if step_unit == "iterations" else 5 * 8)
    rl.close()
    logger.close()


def test_state_dict_version_is_checked():
    with pytest.raises(ConfigurationError, match="expects a state from RLLogging.state_dict"):
        RLLogging(progress=None).load_state_dict({"counters": {}})


def test_collection_carry_is_not_part_of_the_checkpoint():
    assert CollectionMetrics().state_dict() == {}
