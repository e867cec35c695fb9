"""The oldest supported torch: declared once in pyproject.toml, refused clearly at import below it."""

import re
from pathlib import Path

import pytest
import torch

from instrument.torch_floor import MIN_TORCH, check_torch, release
from tests.conftest import run_child

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, expected", [
    ("2.10.0", (2, 10)), ("2.10.0+cu128", (2, 10)), ("2.11.0a0+git1234abc", (2, 11)), ("2.13.0+cpu", (2, 13)),
    ("2.9.1", (2, 9)), ("10.0", (10, 0)), ("nightly", None), ("", None),
])
def test_release_reads_major_and_minor_of_any_torch_version_string(version, expected):
    assert release(version) == expected


@pytest.mark.parametrize("version", ["2.9.1+cu128", "2.6.0", "2.4.1+cu121", "1.13.1", "2.9.0a0+git"])
def test_an_older_torch_is_refused_with_the_release_found_and_the_fix(version):
    with pytest.raises(ImportError) as raised:
        check_torch(version)
    message = str(raised.value)
    assert version in message and "torch >= 2.10" in message and "pip install 'torch>=2.10'" in message


@pytest.mark.parametrize("version", ["2.10.0", "2.10.0a0+git", "2.13.0+cpu", "3.0.0", "a private build"])
def test_the_floor_and_newer_releases_and_unreadable_strings_pass(version):
    check_torch(version)


def test_this_environments_torch_passes():
    check_torch()
    assert release(torch.__version__) >= MIN_TORCH


def test_pyproject_and_make_test_floor_use_the_floor_the_import_checks():
    floor = ".".join(map(str, MIN_TORCH))
    declared = re.findall(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert declared == [floor], declared
    tested = re.findall(r"^TORCH_FLOOR := ([0-9.]+)$", (ROOT / "Makefile").read_text(), re.M)  # test-floor's torch
    assert [release(version) for version in tested] == [MIN_TORCH], tested


def test_importing_instrument_under_an_older_torch_fails_at_once_with_that_message(tmp_path):
    done = run_child(tmp_path, "import torch\ntorch.__version__ = '2.9.1+cu128'\nimport instrument\n")
    assert done.returncode != 0
    assert "ImportError: instrument needs torch >= 2.10, but this environment has torch 2.9.1+cu128" in done.stderr
