"""What the tool tests share (tests/test_tools.py, tests/test_tool_inputs.py): colours, a budget under which
crops come back pixel for pixel, noise images, encodings, a PNG that declares more than it holds (their
`noise` and `square_image` fixtures are in conftest.py, shared by both files)."""

from __future__ import annotations

import io
import random
import struct
import zlib

from hypothesis import HealthCheck, settings
from PIL import Image

from loupe.tools import (
    IMAGE_FACTOR,
    PixelBudget,
)

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
RED, WHITE, BLUE = (255, 0, 0), (255, 255, 255), (0, 0, 255)
NO_RESIZE = PixelBudget(min_pixels=IMAGE_FACTOR * IMAGE_FACTOR, max_pixels=4_000_000)
"""A budget under which a crop whose sides are multiples of 28 comes back pixel for pixel."""


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", (width, height), rng.randbytes(width * height * 3))


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def near(colour: tuple[int, ...], expected: tuple[int, int, int], tolerance: int = 3) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(colour[:3], expected, strict=True))


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares a huge 1-bit image (its pixel data is a few bytes)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
