"""Every visual operation in one scripted dialogue: through the rollout loop on the tiny model's real token
context (Pixelis' call grammar), into the RL learner's batch builder, and onto the trajectory viewer."""

from __future__ import annotations

import pytest
from PIL import Image, ImageDraw, ImageFont

from loupe.config import ProtocolParams
from loupe.data.tasks import TaskRecord
from loupe.models import load_processor
from loupe.protocol import get_protocol
from loupe.rollout.hf import TokenContextEngine
from loupe.rollout.loop import run_rollouts
from loupe.trajectory import read_trajectories, write_trajectories
from loupe.video import write_clip
from loupe.viewer import view_file
from stages.rl.batching import ImageEncoder
from stages.rl.trainer import to_sequence

IMAGE_TURNS = [
    "<think>the red thing</think>\nSEGMENT_OBJECT_AT(x=0.2, y=0.33)",
    "<think>what is it</think>\nGET_PROPERTIES(mask='mask_1')",
    "<think>the sign</think>\nREAD_TEXT(0.5, 0.66, 1.0, 0.95)",
    "<think>upright</think>\nROTATE(90)",
    "<think>closer, on the turned view</think>\nZOOM_IN(0.1, 0.5, 0.6, 0.95, source='observation_2')",
    "<think>done</think>\n<answer>red square, EXIT 7</answer>",
]
VIDEO_TURNS = [
    "<think>first and last</think>\nSELECT_FRAMES(frames=[1, 6])",
    "<think>follow it</think>\nTRACK_OBJECT(0.0, 0.3, 0.25, 0.6, start_frame=1)",
    "<think>it moved right</think>\n<answer>right</answer>",
]


class ScriptedTokenEngine(TokenContextEngine):
    """The real token context (the tiny model's processor expands every image), with scripted assistant turns."""

    name = "scripted-tokens"

    def __init__(self, processor, scripts: dict[str, list[str]]):
        super().__init__(processor, stop=(), temperature=1.0, top_p=1.0, batch_size=8)
        self.scripts = scripts

    def begin(self, system, question, images):
        state = super().begin(system, question, images)
        state.script = list(self.scripts["video" if len(images) > 1 else "image"])
        return state

    def generate(self, states, max_new_tokens):
        out = []
        for state in states:
            ids = self.tokenizer.encode(state.script.pop(0), add_special_tokens=False) + [self.end_ids[0]]
            out.append(self._record(state, ids, [-0.5] * len(ids), "eos"))
        return out


def scene() -> Image.Image:
    image = Image.new("RGB", (400, 300), (200, 200, 200))
    draw = ImageDraw.Draw(image)
    draw.rectangle((50, 60, 129, 139), fill=(220, 30, 30))
    draw.rectangle((210, 210, 390, 270), fill=(255, 255, 255))
    draw.text((222, 218), "EXIT 7", fill=(0, 0, 0), font=ImageFont.load_default(size=36))
    return image


def clip_frames() -> list[Image.Image]:
    frames = []
    for i in range(6):
        frame = Image.new("RGB", (160, 120), (200, 200, 200))
        ImageDraw.Draw(frame).rectangle((8 + 16 * i, 40, 31 + 16 * i, 63), fill=(220, 30, 30))
        frames.append(frame)
    return frames


@pytest.fixture
def rolled_out(tmp_path, tiny_model_dir):
    scene().save(tmp_path / "scene.png")
    write_clip(clip_frames(), tmp_path / "clip.mp4")
    tasks = [
        TaskRecord(doc_id="image", images=["scene.png"], problem="What is the red object, and what does the sign say?",
                   solution="red square, EXIT 7"),
        TaskRecord(doc_id="video", video="clip.mp4", problem="Which way does the square move?", solution="right"),
    ]
    params = ProtocolParams(name="pixelis", max_turns=8, max_images=16, max_context_tokens=8192, video_max_frames=6)
    engine = ScriptedTokenEngine(load_processor(tiny_model_dir), {"image": IMAGE_TURNS, "video": VIDEO_TURNS})
    return run_rollouts(tasks, engine, params, tmp_path, max_new_tokens=64), engine


def test_pixelis_calls_parse_into_the_registered_tools():
    protocol = get_protocol("pixelis")
    calls = [protocol.parse(text).call for text in IMAGE_TURNS[:-1] + VIDEO_TURNS[:-1]]
    assert [c.tool for c in calls] == ["segment_at", "get_properties", "read_text", "rotate", "crop", "select_frames",
                                       "track_object"]
    assert calls[0].arguments == {"point": [0.2, 0.33]}
    assert calls[4].arguments == {"bbox_2d": [0.1, 0.5, 0.6, 0.95], "source": "observation_2"}
    assert calls[6].arguments == {"bbox_2d": [0.0, 0.3, 0.25, 0.6], "start_frame": 1}
    bad = protocol.parse("<think>x</think>\nSEGMENT_OBJECT_AT(x=__import__('os'))")
    assert bad.error is not None and "not literals" in bad.error.detail
    unknown = protocol.parse("FLY_TO(1, 2)")
    assert unknown.error is not None and "unknown operation 'FLY_TO'" in unknown.error.detail
    both = protocol.parse("<answer>red</answer>\nROTATE(90)")
    assert both.error is not None and both.error.kind.value == "call_and_answer"
    assert protocol.parse("<think>ok</think>\n<answer>red</answer>").answer == "red"
    rendered = protocol.render_call("look", calls[0])
    assert protocol.parse(rendered).call == calls[0]


def test_a_dialogue_using_every_operation_runs_through_the_loop(rolled_out):
    trajectories, _ = rolled_out
    image, video = trajectories
    assert image.end_reason == "answered" and video.end_reason == "answered"
    assert image.num_format_errors == 0 and video.num_format_errors == 0
    tool_turns = [t.tool or t.crop for t in image.turns if t.role == "user"][1:]
    assert [t.get("tool", "crop") for t in tool_turns] == ["segment_at", "get_properties", "read_text", "rotate", "crop"]
    segment, properties, sign, turned, zoom = tool_turns
    assert segment["area"] == 6400 and properties["colour"] == "red" and properties["shape"] == "square"
    assert [line["text"] for line in sign["lines"]] == ["EXIT 7"]
    assert "Result: text found: 'EXIT 7'" in image.turns[6].text
    assert turned["observations"] == [2] and zoom["source"] == "observation_2"
    # 1 question image, the segmented object, the rotated view, the zoom of the rotated view.
    assert len(image.images) == 4
    frames, track = [t.tool for t in video.turns if t.role == "user" and t.tool]
    assert frames["frames"] == [1, 6] and frames["observations"] == [1, 2]
    assert len(video.images) == 6 + 2  # the sampled frames, then the two selected again
    boxes = [step["box"] for step in track["track"]]
    assert boxes[-1] is not None and boxes[-1][0] > boxes[0][0] + 0.3  # followed the square to the right


def test_the_learner_encodes_every_image_where_its_placeholder_is(rolled_out, tiny_model_dir):
    trajectories, engine = rolled_out
    encoder = ImageEncoder(engine.processor.image_processor, engine.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    for trajectory in trajectories:
        sequence = to_sequence(trajectory, trained=True, group=trajectory.task["doc_id"])
        pixels, grids = encoder(sequence)  # raises when an image's pad run does not match its patches
        assert grids is not None and grids.shape[0] == len(trajectory.images) == len(sequence.images)
        assert sequence.num_trained == sum(t.num_tokens for t in trajectory.turns if t.role == "assistant")


def test_the_viewer_shows_each_operations_result(rolled_out, tmp_path):
    trajectories, _ = rolled_out
    path = write_trajectories(trajectories, tmp_path / "out" / "trajectories.jsonl")
    again = read_trajectories(path)
    assert [t.tool for t in again[0].turns] == [t.tool for t in trajectories[0].turns]
    page = view_file(path, tmp_path / "out" / "viewer.html").read_text()
    for words in ("segment_at returned", "get_properties returned", "EXIT 7", "rotate returned", "track_object returned",
                  "select_frames returned", "observation 2 (image #"):
        assert words in page, words
