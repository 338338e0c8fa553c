"""What the tools read: the image session, image decoding and its guards, and the tool registry with
run_tool."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

from loupe import tools
from loupe.protocol import ORIGINAL_IMAGE, ToolCall, get_protocol
from loupe.tools import (
    TOOLS,
    CropResult,
    ImageError,
    ImageSession,
    PixelBudget,
    Tool,
    ToolError,
    ToolErrorKind,
    crop,
    open_image,
    register_tool,
    run_tool,
    smart_resize,
)
from tests.tool_cases import (
    BLUE,
    FUZZ,
    NO_RESIZE,
    RED,
    encoded,
    near,
    noise_image,
    png_declaring,
)

# --- ImageSession -----------------------------------------------------------------------------------------


def test_image_session_decodes_the_original_once_across_crops(tmp_path, monkeypatch):
    path = tmp_path / "big.png"
    noise_image(560, 448).save(path)
    decodes = []
    real_open_image = tools.open_image

    def counting_open_image(*args, **kwargs):
        decodes.append(args[0])
        return real_open_image(*args, **kwargs)

    monkeypatch.setattr(tools, "open_image", counting_open_image)
    session = ImageSession(original_path=path)
    assert decodes == []  # lazily: nothing decoded before the first crop
    for box in ([0, 0, 0.5, 0.5], [0.5, 0.5, 1, 1], [0.1, 0.2, 0.3, 0.4]):
        assert isinstance(crop(session, {"bbox_2d": box}, PixelBudget()), CropResult)
    session.add_observation(noise_image(56, 56), (0, 0, 56, 56))
    assert isinstance(crop(session, {"bbox_2d": [0, 0, 1, 1], "source": "observation_0"}, PixelBudget()), CropResult)
    assert isinstance(crop(session, {"bbox_2d": [0, 0, 1, 1], "source": "observation_1"}, PixelBudget()), CropResult)
    assert decodes == [path]


def test_image_session_given_a_decoded_original_never_opens_a_file(monkeypatch, noise):
    def no_decoding(*args, **kwargs):
        raise AssertionError("the original was decoded again")

    monkeypatch.setattr(tools, "open_image", no_decoding)
    monkeypatch.setattr(Image, "open", no_decoding)
    session = ImageSession(original_path=Path("/nonexistent.png"), original=noise)
    assert isinstance(crop(session, {"bbox_2d": [0, 0, 0.5, 0.5]}, PixelBudget()), CropResult)


def test_a_missing_original_file_is_the_datas_fault_and_raises(tmp_path):
    session = ImageSession(original_path=tmp_path / "gone.png")
    call = ToolCall("crop", {"bbox_2d": [0, 0, 1, 1], "source": ORIGINAL_IMAGE})
    with pytest.raises(ImageError, match="gone.png"):
        run_tool(call, session, PixelBudget())


# --- open_image ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "1"])
def test_open_image_decodes_any_mode_to_rgb(tmp_path, mode):
    path = tmp_path / f"image_{mode}.png"
    noise_image(40, 30).convert(mode).save(path)
    image = open_image(path)
    assert image.mode == "RGB" and image.size == (40, 30)


def test_open_image_reads_the_pixels_of_the_file(tmp_path):
    source = noise_image(40, 30)
    source.save(tmp_path / "a.png")
    assert open_image(tmp_path / "a.png").tobytes() == source.tobytes()


def test_open_image_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(ImageError, match="missing.png.*not found"):
        open_image(tmp_path / "missing.png")


def test_open_image_of_a_folder_is_not_a_file(tmp_path):
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(ImageError, match="folder.png"):
        open_image(tmp_path / "folder.png")


@pytest.mark.parametrize("content", [b"", b"not an image at all", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, b"\xff\xd8\xff" + b"junk" * 10])
def test_open_image_of_corrupt_bytes_names_the_file(tmp_path, content):
    path = tmp_path / "corrupt.png"
    path.write_bytes(content)
    with pytest.raises(ImageError, match="corrupt.png"):
        open_image(path)


@pytest.mark.parametrize("fmt, suffix", [("PNG", "png"), ("JPEG", "jpg")])
def test_open_image_of_a_truncated_file_names_the_file(tmp_path, fmt, suffix):
    data = encoded(noise_image(128, 96), fmt)
    path = tmp_path / f"truncated.{suffix}"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match=f"truncated.{suffix}"):
        open_image(path)


@pytest.fixture(scope="module")
def encoded_samples() -> dict[str, bytes]:
    return {
        "png": encoded(noise_image(48, 32), "PNG"),
        "jpg": encoded(noise_image(48, 32), "JPEG", quality=90),
        "palette.png": encoded(noise_image(48, 32).convert("P"), "PNG", optimize=False),
        "progressive.jpg": encoded(noise_image(48, 32), "JPEG", progressive=True),
    }


@FUZZ
@given(kind=st.sampled_from(["png", "jpg", "palette.png", "progressive.jpg"]), cut=st.floats(0.0, 1.0),
       flip=st.one_of(st.none(), st.integers(0, 10_000)))
def test_open_image_of_any_cut_or_damaged_file_decodes_or_raises_image_error(tmp_path, encoded_samples, kind, cut, flip):
    data = bytearray(encoded_samples[kind])
    data = data[: int(len(data) * cut)]
    if flip is not None and data:
        data[flip % len(data)] ^= 0xFF
    path = tmp_path / f"damaged.{kind}"
    path.write_bytes(bytes(data))
    try:
        image = open_image(path)
    except ImageError as err:
        assert "damaged" in str(err)
    else:
        assert image.mode == "RGB" and image.width > 0 and image.height > 0


def test_open_image_refuses_a_decompression_bomb_before_decoding(tmp_path):
    path = tmp_path / "huge.png"
    path.write_bytes(png_declaring(30_000, 30_000))
    assert path.stat().st_size < 1_000
    assert struct.unpack(">II", path.read_bytes()[16:24]) == (30_000, 30_000)  # what the IHDR declares
    with pytest.raises(ImageError, match=r"huge.png.*decompression bomb"):
        open_image(path)


def test_open_image_refuses_an_image_over_its_pixel_limit(tmp_path):
    path = tmp_path / "large.png"
    noise_image(200, 100).save(path)
    with pytest.raises(ImageError, match=r"large.png.*200x100.*over the limit"):
        open_image(path, max_pixels=19_999)
    assert open_image(path, max_pixels=20_000).size == (200, 100)


@pytest.fixture
def image_root(tmp_path) -> Path:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    noise_image(20, 10).save(root / "sub" / "inside.png")
    noise_image(20, 10).save(tmp_path / "outside.png")
    return root


def test_open_image_inside_the_root_works(image_root):
    assert open_image("sub/inside.png", root=image_root).size == (20, 10)
    assert open_image(image_root / "sub" / "inside.png", root=image_root).size == (20, 10)
    (image_root / "link.png").symlink_to(image_root / "sub" / "inside.png")
    assert open_image("link.png", root=image_root).size == (20, 10)


@pytest.mark.parametrize("name", ["../outside.png", "sub/../../outside.png"])
def test_open_image_refuses_a_relative_path_escaping_the_root(image_root, name):
    with pytest.raises(ImageError, match="outside.png.*escapes"):
        open_image(name, root=image_root)


def test_open_image_refuses_an_absolute_path_outside_the_root(image_root):
    with pytest.raises(ImageError, match="outside.png.*escapes"):
        open_image(image_root.parent / "outside.png", root=image_root)


def test_open_image_refuses_a_symlink_pointing_outside_the_root(image_root):
    (image_root / "sub" / "sneaky.png").symlink_to(image_root.parent / "outside.png")
    with pytest.raises(ImageError, match="sneaky.png.*escapes"):
        open_image("sub/sneaky.png", root=image_root)


def test_image_session_honours_its_image_root(image_root):
    session = ImageSession(original_path=Path("../outside.png"), image_root=image_root)
    with pytest.raises(ImageError, match="escapes"):
        crop(session, {"bbox_2d": [0, 0, 1, 1]}, PixelBudget())
    inside = ImageSession(original_path=Path("sub/inside.png"), image_root=image_root)
    assert isinstance(crop(inside, {"bbox_2d": [0, 0, 1, 1]}, PixelBudget()), CropResult)


# --- the registry and run_tool ------------------------------------------------------------------------------


def test_crop_is_registered_with_a_schema():
    tool = TOOLS["crop"]
    assert tool.name == "crop" and tool.run is crop
    assert tool.schema["type"] == "object"
    assert "bbox_2d" in tool.schema["required"]
    assert set(tool.schema["properties"]) >= {"bbox_2d", "source", "frame"}
    assert tool.schema["properties"]["frame"]["enum"] == ["relative", "absolute"]


def test_register_tool_refuses_a_duplicate_name():
    original = TOOLS["crop"]
    with pytest.raises(ValueError, match="already registered"):
        register_tool(Tool("crop", {}, lambda session, arguments, budget: ToolError(ToolErrorKind.BAD_ARGUMENTS, "x")))
    assert TOOLS["crop"] is original


def test_run_tool_with_an_unknown_tool_is_a_tool_error(noise):
    result = run_tool(ToolCall("segment", {"bbox_2d": [0, 0, 1, 1]}), ImageSession(original=noise), PixelBudget())
    assert isinstance(result, ToolError)
    assert result.kind == ToolErrorKind.UNKNOWN_TOOL
    assert "'segment'" in result.detail and "crop" in result.detail


def test_run_tool_with_non_object_arguments_is_a_tool_error(noise):
    result = run_tool(ToolCall("crop", [0, 0, 1, 1]), ImageSession(original=noise), PixelBudget())  # type: ignore[arg-type]
    assert isinstance(result, ToolError) and result.kind == ToolErrorKind.BAD_ARGUMENTS


@pytest.mark.parametrize("protocol, turn, box_px, colour", [
    ("mini_o3", ('<think>red</think><grounding>{"bbox_2d": [0.2, 0.125, 0.3, 0.25], "source": "original_image"}'
                 "</grounding>"), (200, 100, 300, 200), RED),
    ("deepeyes", ('<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [600, 500, 700, 600]}}'
                  "</tool_call>"), (600, 500, 700, 600), BLUE),
])
def test_a_parsed_call_runs_through_run_tool(square_image, protocol, turn, box_px, colour):
    action = get_protocol(protocol).parse(turn)
    result = run_tool(action.call, ImageSession(original=square_image), PixelBudget())
    assert isinstance(result, CropResult) and result.box_px == box_px
    assert all(near(c, colour) for _, c in result.image.getcolors(1 << 16))


def quarter_turn(session: ImageSession, arguments: dict, budget: PixelBudget) -> CropResult | ToolError:
    """A test-only tool registered by hand (no pydantic model): rotate a source by a multiple of 90 degrees."""
    source = arguments.get("source", ORIGINAL_IMAGE)
    image = session.get(source)
    if image is None:
        return ToolError(ToolErrorKind.UNKNOWN_SOURCE, f"there is no image named {source!r}")
    if arguments.get("angle") not in (90, 180, 270):
        return ToolError(ToolErrorKind.BAD_ARGUMENTS, "'angle' must be 90, 180 or 270")
    turned = image.rotate(arguments["angle"], expand=True)
    new_h, new_w = smart_resize(turned.height, turned.width, budget)
    region = session.region(source)
    return CropResult(turned.resize((new_w, new_h)), source, (0, 0, image.width, image.height), region,
                      tuple(round(v) for v in region))


@pytest.fixture
def quarter_turn_tool():
    tool = register_tool(Tool("quarter_turn", {"type": "object", "properties": {"angle": {"enum": [90, 180, 270]}},
                                         "required": ["angle"]}, quarter_turn))
    yield tool
    TOOLS.pop("quarter_turn", None)


def test_a_new_tool_registers_and_runs_through_run_tool(quarter_turn_tool, noise):
    assert TOOLS["quarter_turn"] is quarter_turn_tool
    session = ImageSession(original=noise)
    result = run_tool(ToolCall("quarter_turn", {"angle": 90}), session, NO_RESIZE)
    assert isinstance(result, CropResult)
    assert result.image.size == (896, 1120)
    assert result.image.tobytes() == noise.transpose(Image.Transpose.ROTATE_90).tobytes()
    refused = run_tool(ToolCall("quarter_turn", {"angle": 45}), session, NO_RESIZE)
    assert isinstance(refused, ToolError) and refused.kind == ToolErrorKind.BAD_ARGUMENTS
    unknown = run_tool(ToolCall("segment", {}), session, NO_RESIZE)
    assert "quarter_turn" in unknown.detail  # the error lists every registered tool
