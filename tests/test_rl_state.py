"""RLLogging.load_state_dict refuses a state that is not what state_dict returned, saying which key and why,
instead of resuming from a count it made up (3.7 -> 3, "7" -> 7, -50) or raising a bare KeyError."""

import copy

import numpy as np
import pytest

import instrument
from instrument import ConfigurationError
from instrument.rl import Evaluation, RLLogging


def saved_state(tmp_path):
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path, run_name="saved")
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=100)).attach(inst)
    for _ in range(3):
        with rl.iteration():
            rl.observe_batch(reward=np.ones((4, 2)), done=np.zeros((4, 2), bool))
    state = rl.state_dict()
    rl.close()
    inst.close()
    assert state["counters"] == {"frames": 24, "iterations": 3, "episodes": 0}
    assert state["evaluation"] == {"next_due": 100, "runs": 0}
    return state


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda s: s["counters"].__setitem__("frames", 3.7),
         r"Counters\.load_state_dict: frames must be a non-negative int, got 3\.7 \(float\); Counters\.state_dict\(\) "
         r"\(RLLogging\.state_dict\(\)\['counters'\]\) holds plain ints: load the state it returned"),
        (lambda s: s["counters"].__setitem__("frames", -50), r"frames must be a non-negative int, got -50 \(int\)"),
        (lambda s: s["counters"].__setitem__("iterations", "7"), r"iterations must be a non-negative int, got '7'"),
        (lambda s: s["counters"].__setitem__("episodes", True), r"episodes must be a non-negative int, got True"),
        (lambda s: s["counters"].pop("episodes"), r"Counters\.load_state_dict: the state lacks \['episodes'\]"),
        (lambda s: s.pop("counters"),
         r"RLLogging\.load_state_dict: the state lacks 'counters'; got keys \['components', 'evaluation', "
         r"'session', 'version'\]\. Load the dict RLLogging\.state_dict\(\) returned"),
        (lambda s: s["evaluation"].pop("next_due"),
         r"Evaluation\.load_state_dict: the state lacks 'next_due' \(the frame count the next evaluation is due "
         r"at\); got keys \['runs'\]\. Load the state Evaluation\.state_dict\(\) "
         r"\(RLLogging\.state_dict\(\)\['evaluation'\]\) returned"),
        (lambda s: s["evaluation"].__setitem__("next_due", 1e20),
         r"Evaluation\.load_state_dict: next_due must be a non-negative int, got 1e\+20 \(float\)"),
        (lambda s: s["evaluation"].__setitem__("runs", -1), r"runs must be a non-negative int, got -1"),
    ],
)
def test_a_state_that_is_not_what_state_dict_returned_is_refused_by_key(tmp_path, change, match):
    state = saved_state(tmp_path)
    bad = copy.deepcopy(state)
    change(bad)
    inst = instrument.Instrumentation(backends=[], log_interval=1, log_dir=tmp_path, run_name="resumed")
    rl = RLLogging(progress=None, evaluation=Evaluation(every_frames=100)).attach(inst)
    with pytest.raises(ConfigurationError, match=match):
        rl.load_state_dict(bad)
    assert rl.counters.state_dict() == {"frames": 0, "iterations": 0, "episodes": 0}  # nothing half-loaded
    rl.load_state_dict(state)  # the state as saved loads, numpy ints too
    assert rl.counters.state_dict() == state["counters"] and rl.evaluation.state_dict() == state["evaluation"]
    rl.close()
    inst.close()


def test_numpy_integer_counts_load_as_ints(tmp_path):
    state = saved_state(tmp_path)
    state["counters"] = {k: np.int64(v) for k, v in state["counters"].items()}  # e.g. read back from an npz
    rl = RLLogging(progress=None)
    rl.load_state_dict(state)
    assert rl.counters.state_dict() == {"frames": 24, "iterations": 3, "episodes": 0}
    assert all(type(v) is int for v in rl.counters.state_dict().values())
