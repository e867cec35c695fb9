"""PNG encoding of the images the TensorBoard backend writes: lossless, a few NumPy operations and one zlib call.

``torch.utils.tensorboard.summary.image`` turns a uint8 image into float32 and back (scale, clip, cast), resizes
it to its own size with a Lanczos filter, then has Pillow encode it with adaptive filtering: about 8 ms for one
of the logger's 368 x 314 heatmaps on a 2-core CPU machine (torch 2.13, Pillow 13), on the logger's writer
thread, five of them per logging step of the bench's NCA. `encode_png` writes the same pixels in about 1.7 ms
(files the same size within a few percent): every row but the first is stored as its difference to the row
above (PNG filter type 2, "Up"), which turns the heatmaps' tall blocks of one colour into runs of zeros, and zlib
compresses that at its default level with the GIL released.
"""

import struct
import zlib

import numpy as np

__all__ = ["encode_png", "encodable"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPE = {3: 2, 4: 6}  # channels -> PNG colour type: RGB (truecolour), RGBA (truecolour with alpha)
_UP = 2  # the PNG filter type of a row stored as its difference to the row above
LEVEL = 6  # zlib's default level: level 1 takes half the time for files about a quarter larger


def encodable(image: object) -> bool:
    """Whether `encode_png` takes ``image``: a non-empty uint8 array of shape [H, W, 3] or [H, W, 4]."""
    return (isinstance(image, np.ndarray) and image.dtype == np.uint8 and image.ndim == 3
            and image.shape[2] in _COLOR_TYPE and image.shape[0] > 0 and image.shape[1] > 0)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode_png(image: np.ndarray) -> bytes:
    """The PNG file of ``image`` (see `encodable`): 8 bits per channel, not interlaced."""
    if not encodable(image):
        raise ValueError(
            f"encode_png takes a non-empty uint8 array of shape [H, W, 3] or [H, W, 4], got "
            f"{type(image).__name__} {getattr(image, 'dtype', '')} of shape {getattr(image, 'shape', None)}."
        )
    height, width, channels = image.shape
    rows = image.reshape(height, width * channels)
    filtered = np.empty((height, width * channels + 1), dtype=np.uint8)
    filtered[0, 0] = 0  # the first row as it is (filter type 0)
    filtered[1:, 0] = _UP
    filtered[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])  # modulo 256, as the filter defines it
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPE[channels], 0, 0, 0)
    return (_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(filtered.tobytes(), LEVEL))
            + _chunk(b"IEND", b""))
