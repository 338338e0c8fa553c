"""loupe.png: the pipeline's PNGs written and read back fast, with Pillow's pixels and zlib's bytes."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from loupe import png
from loupe.images import ImageError, open_image
from loupe.png import decode_own_png, encode_png, own_png_size, read_own_png


def _canvas(seed: int = 0, size: tuple[int, int] = (97, 61)) -> Image.Image:
    rng = np.random.default_rng(seed)
    smooth = np.cumsum(rng.integers(-3, 4, size=(size[1], size[0], 3)), axis=0) % 256  # wraps: tests mod-256 rows
    smooth[10:20, 30:50] = (220, 30, 30)
    return Image.fromarray(smooth.astype(np.uint8))


def test_encoded_canvases_decode_to_the_same_pixels_in_pillow_and_in_the_fast_path():
    image = _canvas()
    data = encode_png(image)
    by_pillow = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    fast = decode_own_png(data)
    assert fast is not None and fast.mode == "RGB" and fast.size == image.size
    assert np.array_equal(np.asarray(fast), np.asarray(image))
    assert np.array_equal(by_pillow, np.asarray(image))


def test_the_stream_is_zlibs_byte_for_byte_whichever_library_compresses():
    image = _canvas(1, (300, 200))
    rows = np.asarray(image).reshape(200, 900)
    filtered = np.empty((200, 901), dtype=np.uint8)
    filtered[:, 0] = 2
    filtered[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=filtered[1:, 1:])
    compressor = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_RLE)
    expected = compressor.compress(filtered.tobytes()) + compressor.flush()
    data = encode_png(image)
    length = struct.unpack(">I", data[33:37])[0]
    assert data[41:41 + length] == expected


def test_other_pngs_are_left_to_pillow(tmp_path):
    image = _canvas()
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # Pillow's adaptive filters: not all rows "Up"
    assert decode_own_png(buffer.getvalue()) is None or np.array_equal(
        np.asarray(decode_own_png(buffer.getvalue())), np.asarray(image))
    rgba = io.BytesIO()
    image.convert("RGBA").save(rgba, format="PNG")
    assert own_png_size(rgba.getvalue()) is None
    (tmp_path / "a.jpg").write_bytes(encode_png(image))
    assert read_own_png(tmp_path / "a.jpg") is None  # judged by the name, as open_image judges


def test_a_row_with_another_filter_falls_back_to_pillow():
    image = _canvas()
    data = bytearray(encode_png(image))
    length = struct.unpack(">I", data[33:37])[0]
    raw = bytearray(zlib.decompress(bytes(data[41:41 + length])))
    stride = image.size[0] * 3 + 1
    raw[5 * stride] = 0  # row 5 claims "None": its bytes are now the Up differences themselves
    stream = zlib.compress(bytes(raw))
    rebuilt = png.SIGNATURE + bytes(data[8:33]) + png._chunk(b"IDAT", stream) + png._chunk(b"IEND", b"")
    assert own_png_size(rebuilt) == image.size
    assert decode_own_png(rebuilt) is None
    assert Image.open(io.BytesIO(rebuilt)).convert("RGB").size == image.size


def test_open_image_uses_the_fast_path_and_still_refuses_damage_and_bombs(tmp_path):
    image = _canvas()
    path = tmp_path / "canvas.png"
    path.write_bytes(encode_png(image))
    assert np.array_equal(np.asarray(open_image(path)), np.asarray(image))
    with pytest.raises(ImageError, match="over the limit"):
        open_image(path, max_pixels=100)
    data = bytearray(path.read_bytes())
    data[60] ^= 0xFF  # inside the IDAT stream: the CRC no longer matches, so Pillow judges it
    (tmp_path / "bad.png").write_bytes(bytes(data))
    with pytest.raises(ImageError, match="bad.png"):
        open_image(tmp_path / "bad.png")
    truncated = tmp_path / "short.png"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ImageError, match="short.png"):
        open_image(truncated)


def test_a_damaged_stream_behind_intact_checksums_is_an_image_error(tmp_path):
    image = _canvas()
    data = encode_png(image)
    length = struct.unpack(">I", data[33:37])[0]
    stream = zlib.compress(zlib.decompress(data[41:41 + length])[:-10])  # ten bytes short of the last row
    short = png.SIGNATURE + data[8:33] + png._chunk(b"IDAT", stream) + png._chunk(b"IEND", b"")
    (tmp_path / "cut.png").write_bytes(short)
    with pytest.raises(ImageError, match="cut.png.*expected"):
        open_image(tmp_path / "cut.png")


def test_without_zlib_ng_the_standard_librarys_zlib_writes_and_reads_the_same_files(monkeypatch):
    """Where zlib-ng is missing (the vLLM test venv; the stage images hold it, containers/base/requirements.in):
    the same bytes out, the same pixels back."""
    image = _canvas(2, (120, 80))
    with_installed = encode_png(image)
    monkeypatch.setattr(png, "_zlib", lambda: zlib)
    assert encode_png(image) == with_installed
    assert np.array_equal(np.asarray(decode_own_png(with_installed)), np.asarray(image))
