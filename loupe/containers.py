"""Run a stage locally or in its container image, with the same inputs and outputs either way.

    loupe stage eval --params params.yaml --model work/rl/model --out work/eval    local, or in its image
                                                                                   when LOUPE_CONTAINER is set
    loupe stage eval --in-container --params params.yaml ...                       in its image (podman by default)
    LOUPE_CONTAINER=podman dvc repro                                               every stage in its image

dvc.yaml's commands and the Prefect flow call `loupe stage NAME ...`, so one environment variable moves the
whole pipeline into the images without touching params.yaml. Images are `loupe-NAME:latest`, built by
`make images` (containers/build.sh; docs/containers.md).

What a container run gets, so its outputs match a local run's:
- the workspace (the current directory) mounted at its own absolute path and used as the working directory,
  so relative and absolute paths, DVC's and MLflow's among them, mean the same inside and out; absolute paths
  outside it named on the command line, in params.yaml or in passed variables are mounted the same way;
- the caller's uid and gid (`--userns keep-id` for rootless podman), so outputs are owned as after a local run;
- the host network, so a tracking server, an S3 endpoint or an OpenAI-compatible server on loopback answer;
- the environment that steers a run: LOUPE_* (the parent MLflow run among them), MLFLOW_*, AWS_* (S3),
  HF_*, TRANSFORMERS_*, OPENAI_*, RAY_*, CUDA/NVIDIA device lists, thread counts, and every variable params.yaml
  names in an `api_key_env` field; passed by name (`-e NAME`), so no secret appears on a command line;
- the GPUs when the host has NVIDIA GPUs: `--device nvidia.com/gpu=all` (podman, CDI) or `--gpus all` (docker);
- the code of the mounted workspace (what DVC hashed), run in the image's pinned stack; with
  LOUPE_CONTAINER_CODE=image the code baked into the image at build runs instead.

Settings (environment):
    LOUPE_CONTAINER        podman | docker: run stages in their images; unset, empty or `off`: locally
    LOUPE_IMAGE_TAG        tag of the stage images (default `latest`; `gpu` for containers/build.sh --gpu)
    LOUPE_IMAGE_<STAGE>    one stage's full image name, e.g. LOUPE_IMAGE_EVAL=registry.example/loupe-eval:1.2
    LOUPE_CONTAINER_GPUS   auto (default) | all | none
    LOUPE_CONTAINER_CODE   workspace (default) | image
    LOUPE_CONTAINER_ARGS   more `run` arguments, shell-quoted, e.g. "--shm-size 16g -v /data:/data:ro"
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

STAGES = ("synth", "sft", "rl", "eval")
ENGINES = ("podman", "docker")
PASSED_PREFIXES = ("LOUPE_", "MLFLOW_", "AWS_", "HF_", "TRANSFORMERS_", "OPENAI_", "RAY_")
PASSED_NAMES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "TOKENIZERS_PARALLELISM", "PYTHONHASHSEED", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY")
# The launcher's own settings stay outside: a stage inside an image never launches another container.
LAUNCHER_NAMES = ("LOUPE_CONTAINER", "LOUPE_CONTAINER_GPUS", "LOUPE_CONTAINER_CODE", "LOUPE_CONTAINER_ARGS",
                  "LOUPE_IMAGE_TAG", "LOUPE_IN_CONTAINER")
PODMAN_INIT = Path("/usr/libexec/podman/catatonit")


class ContainerError(ValueError):
    """A container run that cannot start as asked (unknown engine, image missing ...): one line for the user."""


def chosen_engine(requested: str | None, environ: Mapping[str, str]) -> str | None:
    """The engine to run in (None: locally). `requested` is --engine/--in-container's choice."""
    if environ.get("LOUPE_IN_CONTAINER"):
        return None
    engine = requested or environ.get("LOUPE_CONTAINER", "").strip().lower()
    if engine in ("", "off", "0", "false", "no", "local"):
        return None
    if engine not in ENGINES:
        raise ContainerError(f"LOUPE_CONTAINER={engine!r}: expected podman, docker or off")
    return engine


def image_for(stage: str, environ: Mapping[str, str]) -> str:
    return environ.get(f"LOUPE_IMAGE_{stage.upper()}") or f"loupe-{stage}:{environ.get('LOUPE_IMAGE_TAG', 'latest')}"


def gpus_present() -> bool:
    """NVIDIA GPUs on this host: a device node or a working nvidia-smi."""
    if Path("/dev/nvidia0").exists():
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        result = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and "GPU" in result.stdout


def _walk_values(node: Any, key: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk_values(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _walk_values(v, key)
    else:
        yield key, node


def _params_file(stage_args: list[str]) -> Path | None:
    for i, arg in enumerate(stage_args):
        if arg == "--params" and i + 1 < len(stage_args):
            return Path(stage_args[i + 1])
        if arg.startswith("--params="):
            return Path(arg.split("=", 1)[1])
    return Path("params.yaml") if Path("params.yaml").is_file() else None


def _params_values(stage_args: list[str]) -> list[tuple[str, Any]]:
    path = _params_file(stage_args)
    if path is None or not path.is_file():
        return []
    import yaml

    try:
        return list(_walk_values(yaml.safe_load(path.read_text()) or {}))
    except yaml.YAMLError:
        return []  # the stage itself reports a broken params file, naming it


def passed_variables(environ: Mapping[str, str], stage_args: list[str]) -> list[str]:
    """Names of the variables handed to the container (values are read by the engine, not put in argv)."""
    named = {str(v) for k, v in _params_values(stage_args) if k == "api_key_env" and v}
    names = [name for name in sorted(environ)
             if name not in LAUNCHER_NAMES
             and (name.startswith(PASSED_PREFIXES) or name in PASSED_NAMES or name in named)]
    return names


def _absolute_path_in(text: str) -> Path | None:
    value = text.split("=", 1)[1] if text.startswith("--") and "=" in text else text
    name, sep, rest = value.partition("=")
    if sep and re.fullmatch(r"[A-Za-z0-9_-]+", name):  # a NAME=PATH argument (eval's --model base=/models/x)
        value = rest
    if value.startswith("sqlite:///"):
        value = value[len("sqlite:///"):]
        value = "/" + value.lstrip("/") if value.startswith("/") else value
    return Path(value) if value.startswith("/") else None


def mount_points(workspace: Path, candidates: Iterable[str]) -> list[Path]:
    """Folders to mount at their own path: the workspace, then each absolute path outside it (its nearest
    existing folder: an output folder about to be made mounts its parent), none nested in another."""
    wanted = [workspace]
    for text in candidates:
        path = _absolute_path_in(text)
        if path is None or path == Path("/"):
            continue
        path = Path(os.path.normpath(path))
        while not path.exists() and path.parent != path:
            path = path.parent
        if path.is_file():
            path = path.parent
        if path != Path("/") and path.is_dir():
            wanted.append(path)
    chosen: list[Path] = []
    for path in sorted(set(wanted), key=lambda p: len(p.parts)):
        if not any(path == c or path.is_relative_to(c) for c in chosen):
            chosen.append(path)
    return chosen


def _user_args(engine: str) -> list[str]:
    uid, gid = os.getuid(), os.getgid()
    if engine == "podman" and uid != 0:
        return ["--userns", "keep-id"]  # rootless: the caller's id inside is the caller's id outside
    return ["--user", f"{uid}:{gid}"] + ([] if uid == 0 else ["--env", "HOME=/tmp"])


def container_command(stage: str, stage_args: list[str], engine: str, environ: Mapping[str, str] | None = None,
                      workspace: Path | None = None, gpus: bool | None = None) -> list[str]:
    """The `podman|docker run ...` command line that runs `python -m stages.<stage> stage_args` in its image."""
    if stage not in STAGES:
        raise ContainerError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    environ = os.environ if environ is None else environ
    workspace = (workspace or Path.cwd()).resolve()
    names = passed_variables(environ, stage_args)
    gpu_setting = environ.get("LOUPE_CONTAINER_GPUS", "auto").lower()
    if gpu_setting not in ("auto", "all", "none"):
        raise ContainerError(f"LOUPE_CONTAINER_GPUS={gpu_setting!r}: expected auto, all or none")
    want_gpus = gpu_setting == "all" or (gpu_setting == "auto" and (gpus if gpus is not None else gpus_present()))
    code = environ.get("LOUPE_CONTAINER_CODE", "workspace").lower()
    if code not in ("workspace", "image"):
        raise ContainerError(f"LOUPE_CONTAINER_CODE={code!r}: expected workspace or image")

    candidates = [*stage_args, *(environ[n] for n in names),
                  *(str(v) for _, v in _params_values(stage_args) if isinstance(v, str))]
    command = [engine, "run", "--rm", "--network", "host", "--ipc", "host"]
    if engine == "docker" or PODMAN_INIT.exists():
        command.append("--init")  # signals reach the stage, and its children are reaped
    command += _user_args(engine)
    for path in mount_points(workspace, candidates):
        command += ["--volume", f"{path}:{path}"]
    command += ["--workdir", str(workspace)]
    for name in names:
        command += ["--env", name]
    if code == "image":
        command += ["--env", "PYTHONSAFEPATH=1"]  # the working directory's code no longer shadows the image's
    if want_gpus:
        command += ["--device", "nvidia.com/gpu=all"] if engine == "podman" else ["--gpus", "all"]
    command += shlex.split(environ.get("LOUPE_CONTAINER_ARGS", ""))
    command.append(image_for(stage, environ))
    return command + list(stage_args)


def image_revision(engine: str, image: str) -> str | None:
    """The commit an image was built from (its OCI revision label); None when the image is missing."""
    result = subprocess.run([engine, "image", "inspect", "--format",
                             '{{ index .Config.Labels "org.opencontainers.image.revision" }}', image],
                            capture_output=True, text=True, check=False)
    return result.stdout.strip() if result.returncode == 0 else None


def run_stage(stage: str, stage_args: list[str], engine: str | None) -> int:
    """Run the stage here (engine None) or in its image; replaces this process, so signals reach the stage."""
    if stage not in STAGES:
        raise ContainerError(f"unknown stage {stage!r}; stages: {', '.join(STAGES)}")
    if engine is None:
        os.execv(sys.executable, [sys.executable, "-m", f"stages.{stage}", *stage_args])
    if shutil.which(engine) is None:
        raise ContainerError(f"{engine} is not installed (containers/setup-host.sh installs podman)")
    image = image_for(stage, os.environ)
    revision = image_revision(engine, image)
    if revision is None:
        raise ContainerError(f"image {image} not found: build it with `make images` (or containers/build.sh {stage})")
    from loupe.tracking import git_state

    # Images hold no git: the stage's MLflow run is tagged with the commit of the code it runs, told from here.
    head = git_state().get("git_commit", "unknown")
    if os.environ.get("LOUPE_CONTAINER_CODE", "workspace") == "image":
        if revision.split("-")[0] != head:
            print(f"loupe stage: {image} was built from {revision}, the workspace is at {head}", file=sys.stderr)
        head = revision
    os.environ.setdefault("LOUPE_GIT_COMMIT", head)
    command = container_command(stage, stage_args, engine)
    print(f"loupe stage {stage}: in {image} ({engine})", file=sys.stderr)
    sys.stderr.flush()
    os.execvp(command[0], command)
    return 0  # not reached


def add_stage_command(commands: Any) -> None:
    """`loupe stage [--in-container] [--engine podman|docker] NAME ARGS...` on the CLI's subparsers."""
    import argparse

    stage = commands.add_parser(
        "stage", help="run one stage (python -m stages.NAME), locally or in its container image",
        description="Run one stage with ARGS, locally or, with --in-container or LOUPE_CONTAINER=podman|docker, "
                    "in its image. Launcher options may also follow NAME.")
    where = stage.add_mutually_exclusive_group()
    where.add_argument("--in-container", action="store_true", help="run in the stage's image")
    where.add_argument("--local", action="store_true", help="run here even when LOUPE_CONTAINER is set")
    stage.add_argument("--engine", choices=ENGINES, help="container engine (default: LOUPE_CONTAINER, else podman)")
    stage.add_argument("name", choices=STAGES)
    stage.add_argument("args", nargs=argparse.REMAINDER, help="the stage's own arguments")
    stage.set_defaults(func=_cmd_stage)


def _split_launcher_options(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Launcher options written after NAME (stages use none of these names), and the stage's arguments."""
    found: dict[str, Any] = {}
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        if arg in ("--in-container", "--local"):
            found[arg[2:].replace("-", "_")] = True
        elif arg == "--engine":
            found["engine"] = next(items, None)
        elif arg.startswith("--engine="):
            found["engine"] = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if found.get("engine") is not None and found["engine"] not in ENGINES:
        raise ContainerError(f"--engine {found['engine']!r}: expected podman or docker")
    return found, rest


def _cmd_stage(args: Any) -> int:
    late, stage_args = _split_launcher_options(args.args[1:] if args.args[:1] == ["--"] else args.args)
    in_container = args.in_container or late.get("in_container", False)
    local = args.local or late.get("local", False)
    if in_container and local:
        raise ContainerError("--in-container and --local contradict each other")
    engine_flag = args.engine or late.get("engine")
    if local or os.environ.get("LOUPE_IN_CONTAINER"):
        engine = None  # asked for, or already inside an image
    elif in_container or engine_flag:
        from_env = os.environ.get("LOUPE_CONTAINER", "").strip().lower()
        engine = engine_flag or (from_env if from_env in ENGINES else "podman")
    else:
        engine = chosen_engine(None, os.environ)
    return run_stage(args.name, stage_args, engine)
