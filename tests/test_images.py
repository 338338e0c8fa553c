"""The image opener: one decoding rule (upright, on white, 8-bit RGB, first frame) for what the model sees and crops.

Also its refusals (processor-refused shapes, bombs before decoding, names that are not images, paths out of the
root) and a property test: any bytes give an RGB image or an ImageError naming the file, nothing else.
"""

from __future__ import annotations

import io
import random
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile, ImageStat

from loupe.images import (
    IMAGE_SUFFIXES,
    MAX_ASPECT_RATIO,
    ImageError,
    is_image_name,
    open_image,
    resolve_image_path,
)
from loupe.tools import CropResult, ImageSession, PixelBudget, crop

RED, GREEN, BLUE, WHITE = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)
ORIENTATION = 0x0112
"""The EXIF tag of the orientation."""


def near(colour, expected, tolerance: int = 6) -> bool:
    return all(abs(a - b) <= tolerance for a, b in zip(colour[:3], expected, strict=True))


def mean_colour(image: Image.Image) -> tuple[float, ...]:
    return tuple(ImageStat.Stat(image.convert("RGB")).mean)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares a `width` x `height` 1-bit image (its pixel data is a few bytes)."""
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + png_chunk(b"IEND", b""))


# --- EXIF orientation -----------------------------------------------------------------------------------------

STORED_W, STORED_H, BLOCK = 120, 80, 30


@pytest.fixture
def rotated_photo(tmp_path) -> Path:
    """A JPEG stored 120x80, blue with a red 30x30 block at its stored top-left, tagged EXIF orientation 6.

    Orientation 6 (EXIF 2.3, tag 0x0112): the stored 0th row is the visual right-hand side and the stored 0th
    column the visual top. So the upright image is 80x120 and stored pixel (x, y) shows at (79 - y, x): the red
    block is at the upright top-right corner.
    """
    stored = Image.new("RGB", (STORED_W, STORED_H), BLUE)
    stored.paste(RED, (0, 0, BLOCK, BLOCK))
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    path = tmp_path / "photo.jpg"
    stored.save(path, format="JPEG", quality=95, exif=exif.tobytes())
    with Image.open(path) as raw:  # the file really is stored sideways, with the tag
        assert raw.size == (STORED_W, STORED_H) and raw.getexif()[ORIENTATION] == 6
        assert near(raw.convert("RGB").getpixel((5, 5)), RED)
    return path


def upright_xy(x: int, y: int) -> tuple[int, int]:
    """Where stored pixel (x, y) shows in the upright image, by the EXIF definition of orientation 6."""
    return STORED_H - 1 - y, x


def test_exif_orientation_6_is_applied(rotated_photo):
    image = open_image(rotated_photo)
    assert image.mode == "RGB" and image.size == (STORED_H, STORED_W)
    assert near(image.getpixel(upright_xy(BLOCK // 2, BLOCK // 2)), RED)  # the block's centre: (64, 15)
    assert near(image.getpixel(upright_xy(BLOCK // 2, STORED_H - 10)), BLUE)
    assert near(image.getpixel((5, 5)), BLUE)  # where the block would be if the tag were ignored


def test_a_crop_of_an_exif_rotated_photo_is_cut_from_the_upright_image(rotated_photo):
    session = ImageSession(original_path=Path(rotated_photo.name), image_root=rotated_photo.parent)
    budget = PixelBudget()
    # Upright, the red block spans x in [50, 80) and y in [0, 30) of the 80x120 image.
    red = crop(session, {"bbox_2d": [0.66, 0.02, 0.98, 0.22], "frame": "relative"}, budget)
    assert isinstance(red, CropResult) and near(mean_colour(red.image), RED, tolerance=10)
    assert red.region_px[0] >= 50 and red.region_px[3] <= 30
    stored_corner = crop(session, {"bbox_2d": [0.0, 0.0, 0.3, 0.2], "frame": "relative"}, budget)
    assert isinstance(stored_corner, CropResult) and near(mean_colour(stored_corner.image), BLUE, tolerance=10)


def test_an_image_without_orientation_is_left_as_stored(tmp_path):
    stored = Image.new("RGB", (60, 40), BLUE)
    stored.paste(RED, (0, 0, 20, 20))
    exif = Image.Exif()
    exif[ORIENTATION] = 1
    stored.save(tmp_path / "plain.jpg", quality=95, exif=exif.tobytes())
    image = open_image(tmp_path / "plain.jpg")
    assert image.size == (60, 40) and near(image.getpixel((10, 10)), RED)


# --- transparency, bit depth, palette, CMYK -------------------------------------------------------------------


def test_rgba_is_composited_on_white(tmp_path):
    image = Image.new("RGBA", (3, 1))
    image.putdata([(0, 0, 0, 0), (255, 0, 0, 128), (0, 0, 255, 255)])
    image.save(tmp_path / "a.png")
    transparent, half_red, blue = open_image(tmp_path / "a.png").getdata()
    assert transparent == WHITE and blue == BLUE
    assert near(half_red, (255, 127, 127), tolerance=1)  # half red over white, not over black (128, 0, 0)


def test_grey_with_alpha_is_composited_on_white(tmp_path):
    image = Image.new("LA", (2, 1))
    image.putdata([(0, 0), (40, 255)])
    image.save(tmp_path / "la.png")
    assert list(open_image(tmp_path / "la.png").getdata()) == [WHITE, (40, 40, 40)]


def test_a_palette_image_with_a_transparent_index_is_composited_on_white(tmp_path):
    image = Image.new("P", (2, 1))
    image.putpalette([0, 0, 0, 255, 0, 0] + [0] * (254 * 3))
    image.putdata([0, 1])
    image.save(tmp_path / "p.png", transparency=0)
    assert list(open_image(tmp_path / "p.png").getdata()) == [WHITE, RED]


def test_a_palette_gif_without_transparency_gets_its_palette_colours(tmp_path):
    image = Image.new("P", (3, 1))
    image.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (253 * 3))
    image.putdata([2, 0, 1])
    image.save(tmp_path / "p.gif")
    assert list(open_image(tmp_path / "p.gif").getdata()) == [BLUE, RED, GREEN]


@pytest.mark.parametrize("fmt, suffix", [("PNG", "png"), ("TIFF", "tif")])
def test_sixteen_bit_grey_is_scaled_to_eight_bits_not_clipped(tmp_path, fmt, suffix):
    values = np.array([[65535, 32768, 0, 257, 1000]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / f"deep.{suffix}", format=fmt)
    with Image.open(tmp_path / f"deep.{suffix}") as raw:
        assert raw.mode.startswith("I;16")  # what PIL decodes it as; its own convert would clip 1000 to 255
    pixels = [p[0] for p in open_image(tmp_path / f"deep.{suffix}").getdata()]
    assert pixels == [255, 128, 0, 1, 4]  # round(v * 255 / 65535)


def test_sixteen_bit_big_endian_tiff_is_scaled(tmp_path):
    Image.fromarray(np.array([[65535, 32768]], dtype=">u2")).save(tmp_path / "be.tif")
    with Image.open(tmp_path / "be.tif") as raw:
        assert raw.mode == "I;16B"
    assert [p[0] for p in open_image(tmp_path / "be.tif").getdata()] == [255, 128]


def test_thirty_two_bit_integer_grey_is_scaled_as_sixteen_bit_and_clipped(tmp_path):
    Image.fromarray(np.array([[65535, 32768, 70000, -5]], dtype=np.int32)).save(tmp_path / "i.tif")
    with Image.open(tmp_path / "i.tif") as raw:
        assert raw.mode == "I"
    assert [p[0] for p in open_image(tmp_path / "i.tif").getdata()] == [255, 128, 255, 0]


def test_sixteen_bit_grey_with_a_transparent_value_is_composited_on_white(tmp_path):
    Image.fromarray(np.array([[1000, 2000]], dtype=np.uint16)).save(tmp_path / "t.png", transparency=1000)
    assert list(open_image(tmp_path / "t.png").getdata()) == [WHITE, (8, 8, 8)]


def test_sixteen_bit_rgb_png_keeps_its_colours(tmp_path):
    # PIL's PNG decoder reduces 16-bit RGB to 8 bits by itself; build one by hand to check the result.
    rows = b"".join(b"\0" + struct.pack(">HHH", 65535, 32768, 0) * 2 for _ in range(2))
    header = struct.pack(">IIBBBBB", 2, 2, 16, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(rows))
            + png_chunk(b"IEND", b""))
    (tmp_path / "rgb16.png").write_bytes(data)
    assert set(open_image(tmp_path / "rgb16.png").getdata()) == {(255, 128, 0)}


def test_a_cmyk_jpeg_is_converted(tmp_path):
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg", quality=95)  # red in ink
    with Image.open(tmp_path / "cmyk.jpg") as raw:
        assert raw.mode == "CMYK"
    image = open_image(tmp_path / "cmyk.jpg")
    assert image.mode == "RGB" and near(image.getpixel((20, 15)), RED, tolerance=8)


def test_a_one_bit_image_is_black_and_white(tmp_path):
    image = Image.new("1", (2, 1))
    image.putdata([0, 1])
    image.save(tmp_path / "bw.png")
    assert list(open_image(tmp_path / "bw.png").getdata()) == [(0, 0, 0), WHITE]


# --- animated files: the first frame ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, suffix, options", [("GIF", "gif", {}), ("PNG", "png", {}), ("WEBP", "webp", {"lossless": True})]
)
def test_an_animated_file_is_read_as_its_first_frame(tmp_path, fmt, suffix, options):
    frames = [Image.new("RGB", (32, 24), colour) for colour in (RED, GREEN, BLUE)]
    path = tmp_path / f"anim.{suffix}"
    frames[0].save(path, format=fmt, save_all=True, append_images=frames[1:], duration=100, loop=0, **options)
    with Image.open(path) as raw:
        assert getattr(raw, "n_frames", 1) == 3
    image = open_image(path)
    assert image.size == (32, 24) and near(mean_colour(image), RED, tolerance=2)


# --- shapes the processor refuses, and bombs ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [(201, 1), (1, 201), (402, 2), (20_001, 100)])
def test_an_aspect_ratio_over_200_is_refused(tmp_path, size):
    Image.new("L", size, 128).save(tmp_path / "thin.png")
    with pytest.raises(ImageError, match=r"thin.png: .*aspect ratio .* over 200"):
        open_image(tmp_path / "thin.png")


@pytest.mark.parametrize("size", [(200, 1), (1, 200), (400, 2), (1, 1), (3, 2)])
def test_an_aspect_ratio_of_200_and_tiny_images_are_accepted(tmp_path, size):
    # Exactly 200 passes transformers' smart_resize (it raises when max/min > 200), and it has no minimum side.
    assert MAX_ASPECT_RATIO == 200
    Image.new("L", size, 128).save(tmp_path / "small.png")
    assert open_image(tmp_path / "small.png").size == size


@pytest.mark.parametrize("size", [(0, 10), (10, 0)])
def test_an_image_with_a_side_of_no_pixels_is_refused(tmp_path, size):
    (tmp_path / "empty.png").write_bytes(png_declaring(*size))
    with pytest.raises(ImageError, match="empty.png"):
        open_image(tmp_path / "empty.png")


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Records every decode (ImageFile.load) that happens."""
    calls: list[str] = []
    real_load = ImageFile.ImageFile.load

    def recording_load(self):
        calls.append(self.format)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", recording_load)
    return calls


def test_a_decompression_bomb_is_refused_before_decoding(tmp_path, loads):
    (tmp_path / "bomb.png").write_bytes(png_declaring(30_000, 30_000))
    with pytest.raises(ImageError, match=r"bomb.png: image is 30000x30000 .* over the limit .*decompression bomb"):
        open_image(tmp_path / "bomb.png")
    Image.new("RGB", (200, 100)).save(tmp_path / "large.png")
    with pytest.raises(ImageError, match="over the limit"):
        open_image(tmp_path / "large.png", max_pixels=19_999)
    shapes = tmp_path / "thin.png"
    Image.new("L", (1000, 2)).save(shapes)
    with pytest.raises(ImageError, match="aspect ratio"):
        open_image(shapes)
    assert loads == []  # refused from the headers alone
    assert open_image(tmp_path / "large.png", max_pixels=20_000).size == (200, 100)
    assert loads and set(loads) == {"PNG"}  # the recorder does see a decode (load() is called again later)


# --- names, formats and paths ---------------------------------------------------------------------------------


def test_image_suffixes_are_the_common_raster_formats():
    common = {".png", ".jpg", ".jpeg", ".gif", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".jp2", ".avif"}
    assert common <= IMAGE_SUFFIXES
    assert not {".txt", ".json", ".eps", ".pdf", ".svg", ".psd", ".ico", ".tga", ""} & IMAGE_SUFFIXES
    assert is_image_name("A.JPG") and is_image_name("x/y.Png") and not is_image_name("/etc/passwd")


def test_a_file_without_an_image_suffix_is_refused_even_if_it_holds_an_image(tmp_path):
    Image.new("RGB", (40, 30)).save(tmp_path / "a.txt", format="PNG")
    with pytest.raises(ImageError, match=r"a.txt: not an image file name \(suffix '.txt'"):
        open_image(tmp_path / "a.txt")


@pytest.mark.parametrize("fmt", ["ICO", "TGA", "PCX", "EPS"])
def test_a_format_outside_the_list_is_refused_whatever_its_name(tmp_path, fmt):
    buffer = io.BytesIO()
    image = Image.new("RGB", (32, 32), RED)
    if fmt == "EPS":  # writing EPS needs no Ghostscript; reading it would run Ghostscript
        buffer.write(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\n")
    else:
        image.save(buffer, format=fmt)
    (tmp_path / "disguised.png").write_bytes(buffer.getvalue())
    with pytest.raises(ImageError, match="disguised.png: not an image in a supported format"):
        open_image(tmp_path / "disguised.png")


@pytest.fixture
def image_root(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    Image.new("RGB", (40, 30), RED).save(root / "sub" / "inside.png")
    Image.new("RGB", (40, 30), BLUE).save(tmp_path / "outside.png")
    (tmp_path / "elsewhere").mkdir()
    Image.new("RGB", (40, 30), GREEN).save(tmp_path / "elsewhere" / "other.png")
    return root


def test_resolve_image_path_follows_symlinks_inside_the_root(image_root):
    (image_root / "alias.PNG").symlink_to(image_root / "sub" / "inside.png")
    assert resolve_image_path(image_root, "alias.PNG") == (image_root / "sub" / "inside.png").resolve()
    assert resolve_image_path(image_root, "sub/../sub/inside.png") == (image_root / "sub" / "inside.png").resolve()
    assert resolve_image_path(None, "anywhere/x.png") == Path("anywhere/x.png")  # no root: the name only


def test_a_symlinked_folder_leading_out_of_the_root_is_refused(image_root):
    (image_root / "linked").symlink_to(image_root.parent / "elsewhere", target_is_directory=True)
    with pytest.raises(ImageError, match="linked/other.png: image path escapes the image root"):
        open_image("linked/other.png", root=image_root)


@pytest.mark.parametrize("name", ["../outside.png", "/etc/passwd.png", "sub/../../outside.png"])
def test_paths_leaving_the_root_are_refused(image_root, name):
    with pytest.raises(ImageError, match="escapes the image root"):
        resolve_image_path(image_root, name)


def test_a_symlink_loop_is_refused_not_raised(image_root):
    (image_root / "loop.png").symlink_to(image_root / "loop.png")
    with pytest.raises(ImageError, match="loop.png"):
        open_image("loop.png", root=image_root)


def test_an_over_long_name_is_an_image_error(image_root):
    with pytest.raises(ImageError):
        open_image("x" * 5000 + ".png", root=image_root)


# --- any bytes: an RGB image or an ImageError naming the file ----------------------------------------------------

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
FUZZ_PIXEL_LIMIT = 4_000_000
"""A small decode limit, so that a mutated header cannot make a test allocate gigabytes."""


def encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def noise(width: int, height: int, mode: str = "RGB") -> Image.Image:
    return Image.frombytes("RGB", (width, height), random.Random(0).randbytes(width * height * 3)).convert(mode)


def sample_files() -> dict[str, bytes]:
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    frames = [noise(24, 16), noise(24, 16).rotate(90), noise(24, 16).rotate(180)]
    return {
        "png": encoded(noise(24, 16), "PNG"),
        "rgba.png": encoded(noise(24, 16, "RGBA"), "PNG"),
        "palette.png": encoded(noise(24, 16, "P"), "PNG", transparency=3),
        "deep.png": encoded(Image.fromarray(np.arange(384, dtype=np.uint16).reshape(16, 24) * 170), "PNG"),
        "exif.jpg": encoded(noise(24, 16), "JPEG", exif=exif.tobytes()),
        "progressive.jpg": encoded(noise(24, 16), "JPEG", progressive=True),
        "cmyk.jpg": encoded(noise(24, 16, "CMYK"), "JPEG"),
        "anim.gif": encoded(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "anim.png": encoded(frames[0], "PNG", save_all=True, append_images=frames[1:]),
        "anim.webp": encoded(frames[0], "WEBP", save_all=True, append_images=frames[1:]),
        "tif": encoded(noise(24, 16), "TIFF", compression="tiff_lzw"),
        "bmp": encoded(noise(24, 16), "BMP"),
    }


SAMPLES = sample_files()


@st.composite
def damaged(draw) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(sorted(SAMPLES)))
    data = bytearray(SAMPLES[kind])
    for _ in range(draw(st.integers(1, 4))):
        action = draw(st.sampled_from(["flip", "flip", "set", "cut", "insert", "delete"]))
        last = max(len(data) - 1, 0)
        # Mostly past the signature, which a damaged signature alone would stop at (no decoder is reached).
        at = draw(st.integers(0, last) if draw(st.integers(0, 3)) == 0 else st.integers(min(12, last), last))
        if action == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif action == "set" and data:  # header fields: sizes, counts, offsets
            data[at:at + 4] = draw(st.binary(min_size=4, max_size=4))
        elif action == "cut":
            del data[at:]
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "delete":
            del data[at:at + draw(st.integers(1, 16))]
    return kind, bytes(data)


def open_or_refuse(folder: Path, name: str, data: bytes) -> None:
    path = folder / name
    path.write_bytes(data)
    try:
        image = open_image(path, max_pixels=FUZZ_PIXEL_LIMIT)
    except ImageError as err:
        assert str(err).startswith(str(path)), err
    else:
        assert image.mode == "RGB" and image.width >= 1 and image.height >= 1
        assert max(image.size) <= MAX_ASPECT_RATIO * min(image.size)


def test_every_sample_decodes_undamaged(tmp_path):
    for kind, data in SAMPLES.items():
        (tmp_path / f"ok.{kind}").write_bytes(data)
        image = open_image(tmp_path / f"ok.{kind}")
        assert image.mode == "RGB" and image.size in ((24, 16), (16, 24)), kind


@FUZZ
@given(sample=damaged())
def test_a_damaged_image_file_decodes_or_raises_image_error(tmp_path, sample):
    kind, data = sample
    open_or_refuse(tmp_path, f"damaged.{kind}", data)


@FUZZ
@given(data=st.binary(max_size=400), suffix=st.sampled_from([".png", ".jpg", ".gif", ".webp", ".tif", ".bmp", ".ppm"]))
def test_any_bytes_decode_or_raise_image_error(tmp_path, data, suffix):
    open_or_refuse(tmp_path, f"any{suffix}", data)


@FUZZ
@given(magic=st.sampled_from([b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\0\0\0\0WEBPVP8 ", b"II*\0",
                              b"MM\0*", b"BM", b"P6\n", b"\0\0\0\x0cjP  \r\n\x87\n"]),
       rest=st.binary(max_size=300))
def test_a_known_signature_followed_by_any_bytes_decodes_or_raises_image_error(tmp_path, magic, rest):
    open_or_refuse(tmp_path, "signed.png", magic + rest)


def test_a_trajectory_loads_its_original_upright_for_the_viewer(rotated_photo):
    from loupe.trajectory import Trajectory

    trajectory = Trajectory(traj_id="t#0", task={}, protocol="loupe", system="")
    index = trajectory.add_image(rotated_photo)
    image = trajectory.load_image(index)
    assert image.size == (STORED_H, STORED_W) and near(image.getpixel(upright_xy(BLOCK // 2, BLOCK // 2)), RED)


# --- the Hugging Face hub cache: snapshot files are symlinks into the repository's blobs ---------------------


@pytest.fixture
def hub_cache(tmp_path) -> Path:
    """A hub cache with one data set (`datasets--org--bench`), its image stored as a blob, and a second repo."""
    repo = tmp_path / "hub" / "datasets--org--bench"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd0123abcd0123abcd0123abcd0123abcd")
    Image.new("RGB", (40, 30), RED).save(repo / "blobs" / "9f8e7d0000000000000000000000000000000000", format="PNG")
    snapshot = repo / "snapshots" / "0123abcd0123abcd0123abcd0123abcd0123abcd"
    (snapshot / "images").mkdir(parents=True)
    (snapshot / "images" / "a.png").symlink_to(Path("../../../blobs/9f8e7d0000000000000000000000000000000000"))  # as huggingface_hub links them
    other = tmp_path / "hub" / "datasets--org--other" / "blobs"
    other.mkdir(parents=True)
    Image.new("RGB", (40, 30), BLUE).save(other / "0000", format="PNG")
    return snapshot


def test_a_hub_cache_snapshot_file_linked_into_its_blobs_is_accepted(hub_cache):
    image = open_image("images/a.png", root=hub_cache)
    assert image.size == (40, 30) and image.getpixel((0, 0)) == RED
    assert open_image("a.png", root=hub_cache / "images").getpixel((0, 0)) == RED  # a root inside the snapshot


def test_a_hub_cache_link_into_another_repository_or_out_of_the_cache_is_refused(hub_cache, tmp_path):
    (hub_cache / "images" / "theirs.png").symlink_to(tmp_path / "hub" / "datasets--org--other" / "blobs" / "0000")
    Image.new("RGB", (40, 30)).save(tmp_path / "outside.png")
    (hub_cache / "images" / "out.png").symlink_to(tmp_path / "outside.png")
    for name in ("images/theirs.png", "images/out.png", "../../blobs/9f8e7d0000000000000000000000000000000000.png"):
        with pytest.raises(ImageError, match="escapes the image root"):
            resolve_image_path(hub_cache, name)


def test_a_folder_that_only_looks_like_a_hub_cache_gets_no_exception(hub_cache):
    (hub_cache.parent.parent / "refs" / "main").unlink()
    (hub_cache.parent.parent / "refs").rmdir()  # no refs/: not the layout huggingface_hub writes
    with pytest.raises(ImageError, match="escapes the image root"):
        resolve_image_path(hub_cache, "images/a.png")


def test_only_the_last_hop_may_reach_the_blobs(hub_cache):
    # A folder link out of the root, even into the blobs, is refused: the link's own folder must be inside.
    (hub_cache / "store").symlink_to(hub_cache.parent.parent / "blobs", target_is_directory=True)
    (hub_cache.parent.parent / "blobs" / "b.png").symlink_to(hub_cache.parent.parent / "blobs" / "9f8e7d0000000000000000000000000000000000")
    with pytest.raises(ImageError, match="escapes the image root"):
        resolve_image_path(hub_cache, "store/b.png")


def test_the_hub_cache_rule_needs_the_hub_layouts_names(tmp_path):
    (tmp_path / "refs").mkdir()
    (tmp_path / "blobs").mkdir()
    Image.new("RGB", (40, 30)).save(tmp_path / "blobs" / ("ab" * 20), format="PNG")
    Image.new("RGB", (40, 30)).save(tmp_path / "blobs" / "x.png")
    for revision, blob, accepted in [("c" * 40, "ab" * 20, True), ("mine", "ab" * 20, False), ("c" * 40, "x.png", False)]:
        root = tmp_path / "snapshots" / revision
        root.mkdir(parents=True, exist_ok=True)
        link = root / f"{revision}-{blob}.png"
        link.symlink_to(tmp_path / "blobs" / blob)
        if accepted:
            assert resolve_image_path(root, link.name) == (tmp_path / "blobs" / blob).resolve()
        else:
            with pytest.raises(ImageError, match="escapes the image root"):
                resolve_image_path(root, link.name)