"""`instrument.observers.grad_counts`: each gradient's non-finite elements, exact, in order, on every path (the
fused one for float32 and float64, in chunks; the per-gradient one for other dtypes and large CPU gradients)."""

import numpy as np
import pytest
import torch

from instrument.observers import grad_counts as module
from instrument.observers.grad_counts import grad_counts


def _poisoned(numel: int, dtype: torch.dtype, bad: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator, dtype=torch.float64) * 1e3
    where = torch.randperm(numel, generator=generator)[:bad]
    values[where] = torch.tensor([np.nan, np.inf, -np.inf], dtype=torch.float64).repeat(bad)[:bad]
    if dtype.is_complex:
        return torch.complex(values, torch.zeros_like(values)).to(dtype)
    return values.to(dtype)


def _reference(grads):
    """Counted in NumPy, one element at a time being finite or not: no torch kernel involved."""
    return [int(np.count_nonzero(~np.isfinite(g.detach().to(torch.complex128 if g.is_complex() else torch.float64)
                                             .numpy()))) for g in grads]


@pytest.mark.parametrize("chunk", [module.CHUNK, 200])  # 200 bytes: a few gradients to a chunk, or one
def test_counts_of_many_small_float_gradients_are_exact_and_in_order(monkeypatch, chunk):
    monkeypatch.setattr(module, "CHUNK", chunk)
    grads = [_poisoned(n, torch.float32, bad, seed) for seed, (n, bad) in
             enumerate([(1, 0), (7, 7), (64, 3), (0, 0), (33, 1), (4096, 17), (5, 0)] * 3)]
    counts = grad_counts(grads)
    assert counts.dtype == torch.int64 and counts.tolist() == _reference(grads)


def test_every_dtype_and_size_mixed_keeps_its_place():
    """float16/bfloat16 (exact only to 2,048 and 256 in their own dtype), complex, float64, and a CPU gradient
    above CPU_FUSED_MAX go their own ways and come back in the order given."""
    assert module.CPU_FUSED_MAX < 5000
    grads = [
        _poisoned(3000, torch.float16, 2501, 0),  # a count beyond float16's exact integers
        _poisoned(20, torch.float32, 4, 1),
        _poisoned(600, torch.bfloat16, 301, 2),
        _poisoned(90, torch.float64, 90, 3),
        _poisoned(5000, torch.float32, 123, 4),  # above the CPU limit: the per-gradient path
        _poisoned(10, torch.complex64, 2, 5),
        _poisoned(30, torch.float64, 0, 6),
    ]
    assert grad_counts(grads).tolist() == _reference(grads)


def test_a_single_gradient_and_all_finite_ones():
    assert grad_counts([torch.ones(3)]).tolist() == [0]
    grads = [torch.full((5,), 1e38) * 10 for _ in range(4)]  # inf from an overflow: counted
    assert grad_counts(grads).tolist() == [5, 5, 5, 5]


@pytest.mark.cuda
def test_cuda_gradients_are_counted_exactly_with_no_host_sync():
    """On a GPU every float32/float64 gradient takes the fused path (CUDA's L0 norm), large ones included."""
    grads = [_poisoned(n, dtype, bad, seed).cuda() for seed, (n, dtype, bad) in enumerate(
        [(64, torch.float32, 3), (70_000, torch.float32, 5_001), (9, torch.float64, 9), (300, torch.float16, 257),
         (0, torch.float32, 0), (1, torch.float32, 0)])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = grad_counts(grads)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counts.device.type == "cuda" and counts.dtype == torch.int64
    assert counts.tolist() == _reference([g.cpu() for g in grads])


def test_the_fused_path_holds_at_most_chunk_bytes_of_differences_at_once(monkeypatch):
    """3,000 float64 gradients of 4,096 elements (96 MiB): differenced a group of at most CHUNK bytes at a time,
    not all at once (the temporaries stay beside the gradients until their norms are taken)."""
    sizes = []
    real = torch._foreach_sub

    def spy(tensors, others):
        sizes.append(sum(t.numel() * t.element_size() for t in tensors))
        return real(tensors, others)

    monkeypatch.setattr(module, "CPU_FUSED_MAX", 4096)
    monkeypatch.setattr(torch, "_foreach_sub", spy)
    grads = [torch.zeros(4096, dtype=torch.float64) for _ in range(3000)]
    grads[-1][0] = float("nan")
    assert grad_counts(grads).tolist() == [0] * 2999 + [1]
    assert len(sizes) > 1 and max(sizes) <= module.CHUNK and sum(sizes) == 3000 * 4096 * 8


def test_a_sparse_gradient_of_repeated_indices_counts_each_element_of_the_parameter_once(tmp_path):
    """nn.Embedding(sparse=True) leaves an uncoalesced gradient, one row per looked-up index: a row looked up 3
    times with an inf in it was counted 3 times (grad_count 3 for 1 non-finite element, or one finite row summed
    to inf missed). Read back from JSONL against NumPy's count of the dense gradient."""
    import json

    import instrument

    emb = torch.nn.Embedding(10, 4, sparse=True)
    path = tmp_path / "m.jsonl"
    inst = instrument.Instrumentation([instrument.NonFinite(module=emb)], backends=[instrument.JsonlBackend(str(path))],
                                      log_interval=1, log_dir=str(tmp_path))
    with inst.step(0):
        scale = torch.tensor([[np.inf, 1.0, 1.0, 1.0]] * 3 + [[2e38, 1.0, 1.0, 1.0]] * 2)  # the gradient's rows
        (emb(torch.tensor([1, 1, 1, 5, 5])) * scale).sum().backward()
        assert not emb.weight.grad.is_coalesced()
        want = _reference([emb.weight.grad.to_dense()])[0]
    inst.close()
    metrics = json.loads(path.read_text().splitlines()[-1])["metrics"]
    assert want == 2  # row 1's inf; row 5's two finite 2e38 sum to inf (float32)
    assert metrics["nonfinite/grad_count/weight"] == want and metrics["nonfinite/grad_count"] == want
