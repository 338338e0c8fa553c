"""SFT image loading: LLaMA-Factory's per-step image work on the dataset as it is, against its pre-scaled copy.

What a training epoch spends on images is LLaMA-Factory's Qwen2-VL plugin turning every image of every sample
into model inputs: `_get_mm_inputs` (open, decode, scale into image_max_pixels, then the image processor). This
runs it over all samples of a dataset twice, once on the dataset folder as given and once on the copy
`stages.sft.images.presize_dataset` writes, in the same process, and prints seconds per epoch for each and
the ratio. The pixels are identical (tests/test_sft_images.py); only the time differs.

    python benchmarks/sft_presize.py --model work/models/tiny --dataset work/synth/dataset [--max-pixels 50176]

Not a test: a measurement.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from PIL import Image

from stages.sft import checks, images


def epoch_seconds(plugin, processor, samples: list[list[str]]) -> float:
    started = time.perf_counter()
    for paths in samples:
        if paths:
            plugin._get_mm_inputs(paths, [], [], processor)
    return time.perf_counter() - started


def sample_images(folder: Path, spec: checks.DatasetSpec) -> list[list[str]]:
    out = []
    for record in checks.read_records(checks.read_dataset_spec(folder, spec.name)):
        paths = record.get(spec.images) or []
        out.append([p if Path(p).is_absolute() else str(folder / p) for p in paths])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--name", default="loupe_synth")
    parser.add_argument("--max-pixels", type=int, default=50176)
    parser.add_argument("--min-pixels", type=int, default=3136)
    args = parser.parse_args()

    from llamafactory.data.mm_plugin import get_mm_plugin
    from llamafactory.hparams import ModelArguments
    from llamafactory.model import load_tokenizer

    module = load_tokenizer(ModelArguments(model_name_or_path=str(args.model), image_max_pixels=args.max_pixels,
                                           image_min_pixels=args.min_pixels))
    processor = module["processor"]
    plugin = get_mm_plugin("qwen2_vl", image_token="<|image_pad|>")

    spec = checks.read_dataset_spec(args.dataset, args.name)
    records = checks.read_records(spec)
    sizes = {}
    for record in records:
        for p in record.get(spec.images) or []:
            path = Path(p) if Path(p).is_absolute() else spec.folder / p
            if path not in sizes:
                with Image.open(path) as img:
                    sizes[path] = img.size
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        copy, scaled = images.presize_dataset(spec, records, sizes, args.max_pixels, args.min_pixels,
                                              Path(tmp) / "dataset", progress=False)
        once = time.perf_counter() - started
        as_given = epoch_seconds(plugin, processor, sample_images(args.dataset, spec))
        presized = epoch_seconds(plugin, processor, sample_images(copy, spec))
    n_images = sum(len(s) for s in sample_images(args.dataset, spec))
    print(f"{len(records)} samples, {n_images} image uses, {len(sizes)} files, {scaled} pre-scaled (once: {once:.1f} s)")
    print(f"  as given:   {as_given:.2f} s per epoch of image inputs")
    print(f"  pre-scaled: {presized:.2f} s per epoch of image inputs")
    print(f"  ratio:      {as_given / presized:.2f}x less image time per epoch")


if __name__ == "__main__":
    main()
