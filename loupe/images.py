"""Opening the images a user supplies: one decoding rule for what the model is shown and what the crop tool cuts.

`open_image` is the only place a task's image file is decoded (the rollout loop's originals and the crop tool's
`ImageSession` both call it), and `resolve_image_path` is the only path rule (the task-record reader applies it
to every record). Anything wrong with a file raises `ImageError` naming the file, because that is the data's
fault, not the model's.

Policies, one line each:

- Paths: `resolve_image_path(root, path)` resolves `root/path` through every symlink (file or folder); the
  result must lie inside the resolved root, else "escapes the image root" (so `..`, absolute paths elsewhere
  and symlinks out are refused). The task reader also refuses absolute paths outright (see loupe.data.tasks).
- One exception, the Hugging Face hub cache (huggingface_hub's cache layout: `<repo>/snapshots/<revision>/...`
  files are symlinks into `<repo>/blobs/`): when the root lies inside a snapshot, a file symlink whose folder
  is inside the root may resolve into that same repository's `blobs/` folder, and nowhere else outside.
- Names: a path is an image only by its suffix, case-insensitive, from `IMAGE_SUFFIXES` (the extensions PIL
  registers for `IMAGE_FORMATS`, e.g. .png .jpg .jpeg .gif .bmp .tif .webp .ppm .jp2 .avif); anything else
  (/etc/passwd, .txt, .json, no suffix) is refused. A symlink is judged by its own name, not its target's.
- Formats: PIL is only allowed to identify `IMAGE_FORMATS` (PNG/APNG, JPEG/MPO, GIF, BMP, TIFF, WebP, PNM,
  JPEG 2000, AVIF), whatever the suffix; EPS (which runs Ghostscript), PSD, ICO, TGA and the rest are refused.
- Decompression bombs: width x height from the header is checked against `max_pixels` before any pixel is
  decoded (PIL's own global limit is off so the configurable one decides).
- Shape: images whose aspect ratio is over 200 are refused from the header, as Qwen2-VL's image processor
  refuses them (transformers 5.6, models/qwen2_vl/image_processing_qwen2_vl.py, `smart_resize`: it raises
  ValueError when max(h, w) / min(h, w) > 200, and on nothing else). A side under `MIN_IMAGE_SIDE` (1 px,
  i.e. an image with no pixels) is refused; no larger minimum, because the pinned processor has none (the
  `height < factor` check of transformers <= 4.50 is gone) and Loupe resizes every image into the pixel
  budget (sides >= 28) before any processor sees it.
- EXIF orientation: applied (`PIL.ImageOps.exif_transpose`), so the model sees and the crop tool cuts the
  upright image; a file whose EXIF cannot be read is refused.
- Animated files (GIF, APNG, WebP, multi-page TIFF, MPO): the first frame (PIL's frame 0: for APNG the default
  image).
- Transparency (RGBA, LA, PA, P or L/RGB with a `transparency` colour, 16-bit grey with one): composited on
  white.
- 16-bit grey (modes I;16, I;16B, I;16L, I): scaled to 8 bits as round(v * 255 / 65535) after clipping to
  [0, 65535], not clipped at 255 as PIL's own convert does (16-bit RGB(A) PNGs are already reduced to 8 bits
  by PIL's decoder, which keeps the high byte). 32-bit float (mode F) has no defined range: PIL's convert
  (values clipped to [0, 255]).
- Palette, CMYK, YCbCr, LAB, 1-bit and other modes: PIL's `convert("RGB")` (no ICC colour management).
- Any other failure while decoding (PIL raises OSError, SyntaxError, ValueError, struct.error, EOFError,
  ZeroDivisionError, MemoryError and more on damaged files) becomes an ImageError naming the file.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from loupe.png import decode_own_png, own_png_size

# open_image enforces its own, configurable pixel limit before decoding; PIL's fixed global limit would
# otherwise refuse large images first (and warn on 8K benchmark images) whatever max_decode_pixels says.
Image.MAX_IMAGE_PIXELS = None

DEFAULT_MAX_DECODE_PIXELS = 20_000 * 20_000
"""Images larger than this are refused before decoding (decompression-bomb guard)."""
MAX_ASPECT_RATIO = 200
"""Qwen2-VL's image processor refuses images more elongated than this (transformers' `smart_resize`)."""
MIN_IMAGE_SIDE = 1
"""The smallest side accepted; see the module docstring for why it is not larger."""

IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", "GIF", "BMP", "DIB", "TIFF", "WEBP", "PPM", "JPEG2000", "AVIF")
"""PIL format names open_image lets PIL identify (JPEG includes MPO, the multi-picture JPEG of many phones)."""

Image.init()  # registers every plugin's extensions, so the table below is complete
IMAGE_SUFFIXES: frozenset[str] = frozenset(
    suffix for suffix, fmt in Image.registered_extensions().items() if fmt in IMAGE_FORMATS or fmt == "MPO"
)
"""Lower-case file suffixes that name an image: PIL's registered extensions of IMAGE_FORMATS."""

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


class ImageError(ValueError):
    """A source image that cannot be used; the message names the file."""


class ImageTooLarge(ImageError):
    """An image whose header gives more pixels than the limit: refused before it is decoded."""


def image_cell(value: object) -> bytes | str | None:
    """One image cell of a published data set, unpacked: the encoded bytes it embeds, else the path it names,
    else None. A cell is the `datasets` library's Image struct (`{"bytes": ..., "path": ...}`, what parquet files
    on the hub hold: bytes first, the path only when no bytes were stored), raw bytes, or a path string."""
    if isinstance(value, dict):
        if value.get("bytes"):
            return bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return value if isinstance(value, str) and value else None


def is_image_name(path: str | Path) -> bool:
    """Whether the file name ends in one of IMAGE_SUFFIXES (case-insensitive)."""
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


def resolve_image_path(root: str | Path | None, path: str | Path) -> Path:
    """The file `path` names, resolved inside `root`, or ImageError saying why it cannot be an image path.

    `path` must have an image suffix. With `root`, `root/path` is resolved through every symlink and must
    stay inside the resolved root (an absolute `path` counts only if it lies inside). The file need not exist;
    the caller checks that. Without `root`, only the name is checked and `path` comes back as given.
    """
    text = str(path)
    if not text or "\x00" in text:
        raise ImageError(f"{text!r}: not a file path")
    if not is_image_name(text):
        suffix = Path(text).suffix or "none"
        raise ImageError(f"{text}: not an image file name (suffix {suffix!r}; images end in one of "
                         f"{', '.join(sorted(IMAGE_SUFFIXES))})")
    if root is None:
        return Path(path)
    try:
        root_resolved = Path(root).resolve()
        resolved = (root_resolved / path).resolve()
        inside = resolved.is_relative_to(root_resolved) or _is_hub_cache_blob(root_resolved, root_resolved / path,
                                                                               resolved)
    except (OSError, ValueError, RuntimeError) as err:  # unencodable names, over-long paths, symlink loops
        raise ImageError(f"{text}: cannot resolve the path under the image root {root} ({err})") from None
    if inside:
        return resolved
    raise ImageError(f"{text}: image path escapes the image root {root_resolved} (it resolves to {resolved})")


def _is_hub_cache_blob(root: Path, link: Path, target: Path) -> bool:
    """Whether `link`, a file in a Hugging Face hub cache snapshot holding `root`, points into its repo's blobs.

    The hub cache keeps each repository as `<repo>/blobs/<hash>` plus `<repo>/snapshots/<revision>/<path>`
    symlinks to the blobs, so a data set used straight from the cache has every file outside its own folder.
    Only the last hop may leave the root: the link's folder must resolve inside it.
    """
    parts = root.parts
    for i in range(len(parts) - 2, 0, -1):  # `snapshots` followed by at least the revision
        if parts[i] == "snapshots":
            repo = Path(*parts[:i])
            # The layout huggingface_hub writes (file_download.py, `hf_hub_download`): a 40-hex commit folder,
            # a refs/ folder beside blobs/, and blobs named by their hex etag (sha1 or sha256).
            return (_HEX.fullmatch(parts[i + 1]) is not None and len(parts[i + 1]) == 40
                    and (repo / "refs").is_dir() and target.parent == repo / "blobs"
                    and _HEX.fullmatch(target.name) is not None and len(target.name) in (40, 64)
                    and link.parent.resolve().is_relative_to(root))
    return False


_HEX = re.compile(r"[0-9a-f]+")


def open_image(
    path: str | Path, root: str | Path | None = None, max_pixels: int = DEFAULT_MAX_DECODE_PIXELS
) -> Image.Image:
    """Decode an image file fully into an upright RGB image, or raise ImageError naming the file.

    With `root`, the path must resolve inside it (`resolve_image_path`). The module docstring lists the
    decoding rule: EXIF orientation, transparency on white, 16-bit scaling, first frame, size checks.
    """
    path = resolve_image_path(root, path)
    try:
        exists = path.is_file()
    except OSError as err:  # a name too long for the file system, a folder we may not search
        raise ImageError(f"{path}: cannot access the image file ({err.strerror})") from None
    if not exists:
        raise ImageError(f"{path}: image file not found")
    return _decode(path, path, max_pixels)


def open_image_bytes(data: bytes, name: str, max_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> Image.Image:
    """`open_image` for an image held in memory (an upload to `loupe serve`); errors name it `name`."""
    return _decode(io.BytesIO(data), name, max_pixels)


def _decode(source: Path | io.BytesIO, path: Path | str, max_pixels: int) -> Image.Image:
    if isinstance(source, Path) and source.suffix.lower() == ".png":
        # The pipeline's own canvases and crops take the fast path (loupe.png: the same pixels, half the time).
        data = source.read_bytes()
        size = own_png_size(data)
        if size is not None:
            _check_header_size(path, size, max_pixels)
            try:
                image = decode_own_png(data)
            except Exception as err:  # zlib.error, ValueError: a damaged stream behind intact checksums
                raise ImageError(f"{path}: corrupt, truncated or unsupported image ({type(err).__name__}: {err})"[:400]) from None
            if image is not None:
                return image
        source = io.BytesIO(data)
    try:
        with Image.open(source, formats=IMAGE_FORMATS) as img:
            _check_header_size(path, img.size, max_pixels)
            img.load()
            ImageOps.exif_transpose(img, in_place=True)
            return _to_rgb(img)
    except ImageError:
        raise
    except UnidentifiedImageError:
        # PIL tries each allowed plugin; one whose header parse fails (a bad PNG chunk CRC, say) counts as no match.
        raise ImageError(f"{path}: not an image in a supported format ({', '.join(IMAGE_FORMATS)}), "
                         "or its header is damaged") from None
    except Image.DecompressionBombError as err:
        raise ImageError(f"{path}: refused as a decompression bomb ({err})") from None
    except Exception as err:
        # Only decoding runs in this block. PIL's plugins raise a wide, undocumented set of exception types on
        # damaged files (OSError, SyntaxError, ValueError, struct.error, EOFError, IndexError, KeyError,
        # TypeError, ZeroDivisionError, MemoryError, ...); every one means "this file cannot be used".
        detail = f"{type(err).__name__}: {err}"[:300]
        raise ImageError(f"{path}: corrupt, truncated or unsupported image ({detail})") from None


def _check_header_size(path: Path | str, size: tuple[int, int], max_pixels: int) -> None:
    """Refuse, from the header alone, sizes that are bombs, empty, or too elongated for the processor."""
    width, height = size
    if width * height > max_pixels:
        raise ImageTooLarge(
            f"{path}: image is {width}x{height} = {width * height:,} pixels, over the limit of {max_pixels:,} "
            "(a decompression bomb, or raise max_decode_pixels)"
        )
    if min(width, height) < MIN_IMAGE_SIDE:
        raise ImageError(f"{path}: image is {width}x{height}, a side under {MIN_IMAGE_SIDE} px")
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise ImageError(
            f"{path}: image is {width}x{height}, aspect ratio {max(width, height) / min(width, height):.1f} over "
            f"{MAX_ASPECT_RATIO}, which Qwen2-VL's image processor refuses"
        )


def _to_rgb(img: Image.Image) -> Image.Image:
    """The loaded image as 8-bit RGB: 16-bit grey scaled, transparency composited on white."""
    transparency = img.info.get("transparency")
    if img.mode in _SIXTEEN_BIT_MODES:
        values = np.asarray(img).astype(np.int64)
        grey = Image.fromarray(((np.clip(values, 0, 65535) * 255 + 32767) // 65535).astype(np.uint8))
        if not isinstance(transparency, int):
            return grey.convert("RGB")
        alpha = Image.fromarray(np.where(values == transparency, 0, 255).astype(np.uint8))
        img = Image.merge("LA", (grey, alpha))
    elif img.mode == "F":
        img = img.convert("L")
    if img.mode in _ALPHA_MODES or transparency is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        white.alpha_composite(rgba)
        return white.convert("RGB")
    return img.convert("RGB")


def decodes_plainly(path: str | Path) -> bool:
    """Whether a plain `Image.open(path).convert("RGB")` (what LLaMA-Factory's mm_plugin and most loaders do) gives
    the same pixels as `open_image`: no EXIF rotation, no transparency, no 16-bit or float samples. Reads the
    header only. A file for which this is False must be handed to such a loader as `open_image`'s result."""
    try:
        with Image.open(path, formats=IMAGE_FORMATS) as img:
            # PIL's PNG reader decodes the whole image to look for an eXIf chunk after the pixels; a PNG without
            # one anywhere in the file has no orientation, and a byte search is far cheaper than a decode.
            if img.format == "PNG" and b"eXIf" not in Path(path).read_bytes():
                orientation = 1
            else:
                orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
            plain_mode = img.mode not in _SIXTEEN_BIT_MODES + _ALPHA_MODES + ("F",)
            return orientation in (0, 1) and plain_mode and img.info.get("transparency") is None
    except Exception:  # damaged headers: open_image names the problem when the file is decoded
        return False
