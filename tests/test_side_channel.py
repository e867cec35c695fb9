"""Observers are a pure side channel: training with them is bitwise the training without them."""

import torch

import instrument
from instrument.demos.nca import train_nca


def test_nca_parameters_and_gradients_bitwise_identical_with_observers_on_and_off():
    kwargs = dict(steps=3, batch_size=2, size=12, n_iter_min=6, n_iter_max=8, seed=3)
    bare = train_nca(None, **kwargs)["model"]
    inst = instrument.Instrumentation([instrument.IterationStats(), instrument.UpdateNorm()], backends=[],
                                      log_interval=1)
    watched = train_nca(inst, **kwargs)["model"]
    inst.close()
    assert inst._dispatch.calls > 0  # the observers really ran
    for (name, p), q in zip(bare.named_parameters(), watched.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.equal(p.grad, q.grad), name
