"""What the TensorBoard backend encodes itself: the event-record checksums it computes with NumPy
(`instrument.backends.crc32c`), against TensorBoard's own Python implementation, with the event files read back by
TensorBoard's reader (which checks every checksum) and checked record by record; and the PNGs of its images
(`instrument.backends.png`), decoded by Pillow pixel for pixel."""

import io
import os
import random
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as reference_masked
from torch.utils.tensorboard import SummaryWriter

import instrument
from instrument.backends import crc32c as fast
from instrument.backends.png import encodable, encode_png
from instrument.backends.tensorboard import _image
from tests.conftest import event_accumulator, read_scalars

# Lengths around the byte-loop threshold, the 512-byte blocks, the groups of 256 blocks joined at once (a second
# join level beyond them, zero parts in front of a partial group) and the 2048-block gather chunks.
LENGTHS = [*range(0, 70), 511, 512, 513, 1023, 1024, 1025, 1536, 3 * 512 + 1, 5 * 512 - 1, 42_000,
           256 * 512 - 1, 256 * 512, 256 * 512 + 1, 300 * 512 + 3, 2048 * 512 - 1, 2048 * 512, 2048 * 512 + 3,
           3 * 2048 * 512 + 77]


@pytest.mark.parametrize("length", LENGTHS)
def test_same_checksum_as_tensorboard(length):
    data = random.Random(length).randbytes(length)
    assert fast.masked_crc32c(data) == reference_masked(data)


@pytest.mark.parametrize("pattern", [b"\x00", b"\xff", bytes(range(256)), b"\x01\x00\x00\x80"])
def test_patterns(pattern):
    data = pattern * (5000 // len(pattern) + 1)
    assert fast.masked_crc32c(data) == reference_masked(data)
    assert fast.masked_crc32c(memoryview(data)) == reference_masked(data)


def test_known_value():
    assert fast.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert fast.crc32c(b"") == 0


def test_tables_built_once_under_threads(monkeypatch):
    monkeypatch.setattr(fast, "_tables", None)
    data = [random.Random(i).randbytes(600_000 + i) for i in range(6)]
    expected = [reference_masked(d) for d in data[:2]]  # the reference is slow: two are enough to pin the values
    results, errors = {}, []

    def work(i):
        try:
            results[i] = fast.masked_crc32c(data[i])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(data))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[0], results[1]] == expected
    assert [results[i] for i in range(len(data))] == [fast.masked_crc32c(d) for d in data]


def _records(path: Path):
    """Every record of an event file: (data, stored header checksum, stored data checksum, header)."""
    raw = path.read_bytes()
    at = 0
    while at < len(raw):
        header = raw[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", raw[at + 8:at + 12])
        data = raw[at + 12:at + 12 + length]
        (data_crc,) = struct.unpack("<I", raw[at + 12 + length:at + 16 + length])
        yield data, header_crc, data_crc, header
        at += 16 + length
    assert at == len(raw)


def _check_files(log_dir: Path) -> int:
    count = 0
    for path in log_dir.rglob("events.out.tfevents.*"):
        for data, header_crc, data_crc, header in _records(path):
            assert header_crc == reference_masked(header)
            assert data_crc == reference_masked(data)
            count += 1
    return count


def test_backend_writes_records_tensorboard_reads(tmp_path):
    backend = instrument.TensorBoardBackend()
    inst = instrument.Instrumentation(observers=[], backends=[backend], log_dir=str(tmp_path), run_name="run",
                                      log_interval=1)
    rng = np.random.default_rng(0)
    heatmaps = [rng.normal(size=(16, 32)).astype(np.float32) for _ in range(4)]
    for step, heatmap in enumerate(heatmaps):
        with inst.step(step):
            inst.logger.log_metrics({"loss": float(step) / 3}, step=step)
            inst.logger.log_heatmap("map", torch.from_numpy(heatmap), step=step)
    record_writer = backend._writer._get_file_writer().event_writer._async_writer._writer
    assert type(record_writer).__name__ == "FastRecordWriter"
    inst.close()
    assert _check_files(tmp_path / "run") >= 1 + 2 * len(heatmaps)  # file version, then scalars and an image each
    assert read_scalars(tmp_path / "run")["loss"] == {s: pytest.approx(s / 3) for s in range(4)}
    acc = event_accumulator(tmp_path / "run")
    assert [e.step for e in acc.Images(next(t for t in acc.Tags()["images"] if "map" in t))] == [0, 1, 2, 3]


def test_given_writer_is_made_fast_and_keeps_its_own_events(tmp_path):
    writer = SummaryWriter(log_dir=str(tmp_path / "mine"))
    inst = instrument.Instrumentation(observers=[], backends=[instrument.TensorBoardBackend(writer=writer)],
                                      log_dir=str(tmp_path), run_name="run", log_interval=1)
    with inst.step(0):
        inst.logger.log_metrics({"a": 1.5}, step=0)
    writer.add_scalar("mine", 2.5, 0)  # the user's own call goes through the same record writer
    inst.close()
    writer.close()
    assert _check_files(tmp_path / "mine") >= 3
    scalars = read_scalars(tmp_path / "mine")
    assert scalars["a"] == {0: 1.5} and scalars["mine"] == {0: 2.5}


def test_reopened_writer_after_a_resume_is_fast(tmp_path):
    backend = instrument.TensorBoardBackend(log_dir=str(tmp_path / "tb"))
    backend.open(None)
    backend.on_resume(5)
    record_writer = backend._writer._get_file_writer().event_writer._async_writer._writer
    assert type(record_writer).__name__ == "FastRecordWriter"
    backend.close()
    assert _check_files(tmp_path / "tb") >= 4  # two files: a version record each, and the two purge markers


def test_anything_else_is_left_alone():
    class NotAWriter:
        pass

    thing = NotAWriter()
    assert fast.use_fast_checksums(thing) is False
    assert type(thing) is NotAWriter
    assert fast.use_fast_checksums(os) is False


def _decoded(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 7, 4), (9, 1, 3), (314, 368, 3), (33, 17, 4)])
def test_png_round_trip(shape):
    rng = np.random.default_rng(sum(shape))
    noise = rng.integers(0, 256, size=shape, dtype=np.uint8)
    blocks = np.repeat(np.repeat(rng.integers(0, 256, size=(3, 2, shape[2]), dtype=np.uint8), 40, 0), 30, 1)
    for image in (noise, blocks[:shape[0], :shape[1]], np.zeros(shape, np.uint8), np.full(shape, 255, np.uint8)):
        png = encode_png(image)
        decoded = _decoded(png)
        assert decoded.shape == image.shape and decoded.dtype == np.uint8
        np.testing.assert_array_equal(decoded, image)
        assert Image.open(io.BytesIO(png)).mode == ("RGB" if shape[2] == 3 else "RGBA")


def test_png_of_a_view():
    image = np.random.default_rng(0).integers(0, 256, size=(3, 20, 30), dtype=np.uint8).transpose(1, 2, 0)
    assert not image.flags.c_contiguous
    np.testing.assert_array_equal(_decoded(encode_png(image)), image)
    np.testing.assert_array_equal(_decoded(encode_png(image[::-2, 1::3])), image[::-2, 1::3])


@pytest.mark.parametrize("bad", [np.zeros((4, 4, 3), np.float32), np.zeros((4, 4), np.uint8),
                                 np.zeros((4, 4, 1), np.uint8), np.zeros((0, 4, 3), np.uint8), [[1, 2, 3]]])
def test_png_refuses_what_it_cannot_encode(bad):
    assert not encodable(bad)
    with pytest.raises(ValueError, match="uint8 array of shape"):
        encode_png(bad)


def test_image_summary_fields_and_fallback():
    image = np.random.default_rng(3).integers(0, 256, size=(5, 6, 4), dtype=np.uint8)
    summary = _image("img", image)
    (value,) = summary.value
    assert (value.tag, value.image.height, value.image.width, value.image.colorspace) == ("img", 5, 6, 4)
    np.testing.assert_array_equal(_decoded(value.image.encoded_image_string), image)
    floats = np.linspace(0, 1, 5 * 6 * 3, dtype=np.float32).reshape(5, 6, 3)  # not the logger's: TensorBoard's path
    (value,) = _image("f", floats).value
    np.testing.assert_array_equal(_decoded(value.image.encoded_image_string), (floats * 255).astype(np.uint8))


def test_logged_rgba_image_reads_back(tmp_path):
    inst = instrument.Instrumentation(observers=[], backends=[instrument.TensorBoardBackend()],
                                      log_dir=str(tmp_path), run_name="run", log_interval=1)
    image = np.random.default_rng(4).integers(0, 256, size=(12, 10, 4), dtype=np.uint8)
    with inst.step(0):
        inst.logger.log_image("rgba", image, step=0)
    inst.close()
    (event,) = event_accumulator(tmp_path / "run").Images("rgba")
    np.testing.assert_array_equal(_decoded(event.encoded_image_string), image)
