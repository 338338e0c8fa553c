"""The embedded tiny model as a versioned artefact: built once by a documented command, committed with a manifest
of its files' SHA-256 hashes, checked by hash before each use.

Why: the tiny model's perception pretraining (loupe.models.tiny_perception) does not give the same weights on
every CPU. Torch picks its kernels by the CPU's instruction sets, their float sums differ in the last bits, and
over 2,400 steps those bits grew into different models (held-out colour accuracy 0.30 on one kernel set, 0.93 on
another; docs/learning.md). Built in every data stage, the default's base model depended on the machine. Built
once and shipped, it is the same model everywhere, and the data stage copies it in a second instead of training
for minutes.

    loupe model tiny --out assets/tiny-model --perception-steps 2400     # or: make tiny-model

writes the model and `loupe-tiny.json` beside it:

    {"build": {"seed": 0, "text_hidden": 128, "text_layers": 4, "perception_steps": 2400},
     "perception": {"steps": 2400, "first_loss": ..., "final_loss": ..., "held_out_accuracy": 0.93},
     "files": {"model.safetensors": "<sha256>", ...},
     "built_with": {"torch": "2.x", "cpu_capability": "AVX512", "command": "loupe model tiny ..."}}

The data stage (pipelines/data_stage.py) uses the artefact named by `model.tiny_artifact` when its `build`
matches the `model` section's tiny settings, and builds the model as before when it does not (another seed,
width or step count), saying so. dvc.yaml lists the artefact as the data stage's dependency, so DVC records its
hash in dvc.lock and a rebuilt artefact reruns the pipeline.

Hashes are hashlib's (loupe.io.file_digest); no library checks a folder against a manifest more simply.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loupe.io import file_digest

MANIFEST = "loupe-tiny.json"
"""The manifest's file name inside the artefact folder."""


class ArtifactError(ValueError):
    """An artefact whose files do not match its manifest, or a folder that is no artefact."""


def sha256(path: Path) -> str:
    return file_digest(path)


def build_settings(seed: int, text_hidden: int, text_layers: int, perception_steps: int,
                   family: str = "qwen2_5_vl") -> dict[str, Any]:
    """What an artefact was built with (and what the `model` section asks for): the manifest's `build`. The
    family is named only when it is not the default Qwen2.5-VL, so manifests written before families keep
    matching."""
    settings: dict[str, Any] = {"seed": seed, "text_hidden": text_hidden, "text_layers": text_layers,
                                "perception_steps": perception_steps}
    return settings if family == "qwen2_5_vl" else {**settings, "family": family}


def build_artifact(out_dir: str | Path, settings: dict[str, int], command: str = "", progress: bool = False) -> dict:
    """Build the tiny model with `settings` into `out_dir` (atomically), pretrain its perception, write the
    manifest; returns the manifest."""
    import torch

    from loupe.io import atomic_directory
    from loupe.models.tiny import build_tiny_model
    from loupe.models.tiny_perception import pretrain_perception

    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        build_tiny_model(tmp, seed=settings["seed"], text_hidden=settings["text_hidden"],
                         text_layers=settings["text_layers"], family=settings.get("family", "qwen2_5_vl"))
        report = {}
        if settings["perception_steps"]:
            report = asdict(pretrain_perception(tmp, steps=settings["perception_steps"], seed=settings["seed"],
                                                progress=progress))
        manifest = {
            "build": settings,
            "perception": report,
            "files": {p.name: sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()},
            "built_with": {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                           "command": command},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The artefact's manifest, after checking every listed file's hash; raises ArtifactError naming the file."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        manifest["build"]
    except FileNotFoundError:
        raise ArtifactError(f"{folder}: no {MANIFEST}; build the artefact with `loupe model tiny --out {folder}`") from None
    except (ValueError, KeyError, TypeError) as error:
        raise ArtifactError(f"{path}: not a tiny-model manifest ({error})") from None
    for name, expected in files.items():
        file = folder / name
        if not file.is_file():
            raise ArtifactError(f"{file}: listed in {path} but missing")
        if sha256(file) != expected:
            raise ArtifactError(f"{file}: its SHA-256 differs from {path}'s; the artefact was changed or damaged "
                                f"(rebuild it with `loupe model tiny --out {folder}`, or restore it with git)")
    return manifest


def copy_artifact(folder: str | Path, out_dir: str | Path, manifest: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copy an artefact's model files (not its manifest) into `out_dir`; returns the manifest. `manifest`: one
    `read_manifest` already checked (the files are not hashed a second time); None checks them here."""
    manifest = read_manifest(folder) if manifest is None else manifest
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in manifest["files"]:
        shutil.copyfile(Path(folder) / name, out_dir / name)
    return manifest
