"""The pipeline's own PNG files: written fast, and read back fast; any other PNG is Pillow's.

Every canvas, crop and pre-scaled SFT image Loupe writes is an 8-bit RGB PNG with one IDAT chunk whose rows
all use the "Up" filter (`encode_png`). Those files are written and read many times over a run (the data stage
writes ~2,000 megapixel canvases; synth, SFT's pre-scaling, the RL rollouts and eval each decode them again),
and most of that time is zlib's. Both directions here are hand-written rather than Pillow's for speed, on
identical pixels:

- Pillow's encoder tries all five row filters on every row; `encode_png` uses "Up" everywhere (one numpy
  subtraction, the right choice for these smooth backgrounds) and zlib's run-length strategy (Z_RLE).
- Pillow's decoder inflates with the system zlib and unfilters row by row in C for any filter mix;
  `decode_own_png` recognises `encode_png`'s layout and undoes it with one inflate and one numpy add per row.

Inflating and deflating use zlib-ng (`zlib_ng`, python-zlib-ng) where it is installed, else the standard
library's zlib. zlib-ng's deflate with Z_RLE at level 1 writes the same bytes as zlib's (the algorithm, RLE
matches of the previous byte only, leaves no choice; tests/test_png.py checks it) in about half the time, and
its inflate is about twice as fast; so files, hashes and `dvc.lock` do not depend on which is present. The
PNG layout follows the PNG specification (W3C, 2nd edition: 11.2.2 IHDR, 9.2 filter type 2 "Up", 5.3 chunk
CRCs); the files open in any PNG reader.
"""

from __future__ import annotations

import struct
import zlib as _stdlib_zlib
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image


@cache
def _zlib() -> Any:
    """zlib-ng where installed (the CPU stack and every stage image pin it), else the standard library's zlib: the
    same streams. Imported at the first PNG, not with this module: loupe.rewards reaches it through loupe.images,
    and an environment without zlib-ng (the vLLM test venv) imports the rewards too."""
    try:
        from zlib_ng import zlib_ng
    except ImportError:  # pragma: no cover - environments without zlib-ng
        return _stdlib_zlib
    return zlib_ng

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_UP = 2  # PNG filter type 2: each byte minus the byte above it (mod 256)
# encode_png's layout: signature, IHDR (13 bytes of data), then one IDAT: its length and tag start at byte 33.
_IDAT_AT = len(SIGNATURE) + 8 + 13 + 4


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", _stdlib_zlib.crc32(tag + data))


def encode_png(image: Image.Image, level: int = 1) -> bytes:
    """An image as 8-bit RGB PNG bytes, about four times as fast as Pillow's encoder on the canvases.

    No metadata chunks, so the bytes depend on the pixels and `level` alone (the same with zlib or zlib-ng).
    """
    pixels = np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)
    height, width, _ = pixels.shape
    rows = pixels.reshape(height, width * 3)
    filtered = np.empty((height, width * 3 + 1), dtype=np.uint8)
    filtered[:, 0] = _UP
    filtered[0, 1:] = rows[0]  # the row above the first is zeros: stored as is
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])
    zlib = _zlib()
    compressor = zlib.compressobj(level, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    data = compressor.compress(filtered.tobytes()) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, deflate, adaptive filters, no interlace
    return SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def own_png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) when `data` has `encode_png`'s layout (8-bit RGB, not interlaced, one IDAT then IEND,
    intact CRCs), else None. Reads the chunk headers and checksums, not the pixels."""
    if len(data) < _IDAT_AT + 8 or not data.startswith(SIGNATURE) or data[12:16] != b"IHDR":
        return None
    if struct.unpack(">I", data[8:12])[0] != 13 or data[24:29] != b"\x08\x02\x00\x00\x00":
        return None
    if struct.unpack(">I", data[29:33])[0] != _stdlib_zlib.crc32(data[12:29]):
        return None
    length = struct.unpack(">I", data[_IDAT_AT:_IDAT_AT + 4])[0]
    end = _IDAT_AT + 8 + length
    if data[_IDAT_AT + 4:_IDAT_AT + 8] != b"IDAT" or data[end + 4:] != _chunk(b"IEND", b""):
        return None
    if struct.unpack(">I", data[end:end + 4])[0] != _zlib().crc32(data[_IDAT_AT + 4:end]):
        return None
    width, height = struct.unpack(">II", data[16:24])
    return (width, height) if width and height else None


def decode_own_png(data: bytes) -> Image.Image | None:
    """The RGB image in `data` when it has `encode_png`'s layout and every row is Up-filtered, else None (the
    caller then decodes with Pillow). Raises zlib's error on a corrupt stream, ValueError on a short one."""
    size = own_png_size(data)
    if size is None:
        return None
    width, height = size
    length = struct.unpack(">I", data[_IDAT_AT:_IDAT_AT + 4])[0]
    raw = _zlib().decompress(data[_IDAT_AT + 8:_IDAT_AT + 8 + length])
    stride = width * 3 + 1
    if len(raw) != height * stride:
        raise ValueError(f"PNG image data holds {len(raw)} bytes, {height * stride} expected for {width}x{height} RGB")
    filtered = np.frombuffer(raw, dtype=np.uint8).reshape(height, stride)
    if not (filtered[:, 0] == _UP).all():
        return None
    pixels = np.empty((height, width * 3), dtype=np.uint8)
    pixels[0] = filtered[0, 1:]
    for row in range(1, height):  # uint8 addition wraps mod 256, as the filter's subtraction did
        np.add(pixels[row - 1], filtered[row, 1:], out=pixels[row])
    return Image.fromarray(pixels.reshape(height, width, 3))


def read_own_png(path: str | Path) -> Image.Image | None:
    """`decode_own_png` of a file whose name ends in .png; None for any other file."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        return None
    return decode_own_png(path.read_bytes())
