"""PNG encoding of the images the TensorBoard backend writes: lossless, a few NumPy operations and one zlib call.

``torch.utils.tensorboard.summary.image`` turns a uint8 image into float32 and back (scale, clip, cast), resizes
it to its own size with a Lanczos filter, then has Pillow encode it with adaptive filtering: about 8 ms for one
of the logger's 368 x 314 heatmaps on a 2-core CPU machine (torch 2.13, Pillow 13), on the logger's writer
thread, four of them per logging step of the bench's NCA. `encode_png` writes the same pixels in about 0.8 ms:
every row but the first is stored as its difference to the row above (PNG filter type 2, "Up"), which turns the
heatmaps' tall blocks of one colour into runs of zeros, and zlib compresses that with the GIL released.

zlib runs at level 3 (`LEVEL`), not its default 6: on the bench NCA's four heatmaps of a logging step, level 6
takes 8.1 ms for 35 KB, level 3 3.1 ms for 43 KB (level 1: 3.3 ms, 45 KB; 2-core CPU machine). The GIL is
released either way, but a loop that logs every step waits for the writer thread once it falls behind (a full
queue, ``flush``, ``close``), and on a machine with few cores the compression competes with training for them:
21% larger image records for 2.6x less of that work.
"""

import struct
import zlib

import numpy as np

__all__ = ["encode_png", "encodable"]

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_COLOR_TYPE = {3: 2, 4: 6}  # channels -> PNG colour type: RGB (truecolour), RGBA (truecolour with alpha)
_UP = 2  # the PNG filter type of a row stored as its difference to the row above
LEVEL = 3  # zlib's level: 2.6x faster than its default 6 on heatmaps, files about a fifth larger


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
