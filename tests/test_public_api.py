"""The public surface is exactly what __all__ says, and every name in it exists."""

import instrument


def test_all_names_exist_and_nothing_public_is_missing():
    for name in instrument.__all__:
        assert hasattr(instrument, name), name
    module = type(instrument)
    public = {n for n in vars(instrument) if not n.startswith("_") and not isinstance(getattr(instrument, n), module)}
    assert public <= set(instrument.__all__), public - set(instrument.__all__)
