"""Opening the images a user supplies: one decoding rule for what the model is shown and what the crop tool cuts.

`open_image` is the only place a task's image file is decoded. A missing, corrupt, truncated or oversized file,
or a path outside the configured image root, raises `ImageError` naming the file, because that is the data's
fault, not the model's.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

# open_image enforces its own, configurable pixel limit before decoding; PIL's fixed global limit would
# otherwise refuse large images first (and warn on 8K benchmark images) whatever max_decode_pixels says.
Image.MAX_IMAGE_PIXELS = None

DEFAULT_MAX_DECODE_PIXELS = 20_000 * 20_000
"""Images larger than this are refused before decoding (decompression-bomb guard)."""


class ImageError(ValueError):
    """A source image that cannot be used; the message names the file."""


def open_image(path: str | Path, root: str | Path | None = None, max_pixels: int = DEFAULT_MAX_DECODE_PIXELS) -> Image.Image:
    """Decode an image file fully into RGB, or raise ImageError naming the file and what is wrong.

    With `root`, the resolved path must lie inside it (no `..` or symlink escapes).
    """
    path = Path(path)
    if root is not None:
        root_resolved = Path(root).resolve()
        resolved = (root_resolved / path).resolve() if not path.is_absolute() else path.resolve()
        if not resolved.is_relative_to(root_resolved):
            raise ImageError(f"{path}: image path escapes the image root {root_resolved}")
        path = resolved
    if not path.is_file():
        raise ImageError(f"{path}: image file not found")
    try:
        with Image.open(path) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise ImageError(
                    f"{path}: image is {width}x{height} = {width * height:,} pixels, over the limit of {max_pixels:,} "
                    "(a decompression bomb, or raise max_decode_pixels)"
                )
            img.load()
            return img.convert("RGB")
    except ImageError:
        raise
    except Image.DecompressionBombError as err:
        raise ImageError(f"{path}: refused as a decompression bomb ({err})") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageError(f"{path}: corrupt or truncated image ({err})") from None
