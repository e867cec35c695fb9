"""The bench's INSTRUMENT_BENCH_DEVICE option: a value that names no device the workloads can run on is refused
with an error that names the option, before anything is timed."""

import pytest


@pytest.mark.parametrize("name", ["meta", "mps", "gpu", "cuda:x"])
def test_a_device_the_workloads_cannot_run_on_is_refused_naming_the_option(tmp_path, monkeypatch, name):
    from bench.workloads import build_variants

    monkeypatch.setenv("INSTRUMENT_BENCH_DEVICE", name)
    with pytest.raises(ValueError, match="INSTRUMENT_BENCH_DEVICE"):
        variants = build_variants(["nca/eager/bare", "nca/eager/log-tb"], tmp=str(tmp_path))
        for variant in variants:
            if variant.fn is not None:
                variant.fn()
