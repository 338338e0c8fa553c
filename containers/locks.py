"""Lock files of the stage images: resolve them, check them against their index, fetch their wheels.

Every image installs exactly one lock file, `containers/<stage>/requirements.<stack>.lock`: each package at
one version with the sha256 of the one file chosen for the image's interpreter and platform, so a build
repeats and pip refuses anything else (`--require-hashes`, which also fails when a dependency is missing from
the lock). Locks are resolved from `requirements.<stack>.in` (which includes `base/requirements.in`); CPU
locks follow requirements/cpu.txt's versions wherever the CPU stack has the package.

    python containers/locks.py lock  [TARGET...]   re-resolve (uv, then pip --dry-run --report; installs nothing),
                                                   keeping the lock's versions that still fit (--upgrade: afresh)
    python containers/locks.py check [TARGET...]   each lock resolves against its index, closed and hash-exact
    python containers/locks.py fetch TARGET --dest DIR   download its wheels for an offline build
    python containers/locks.py list                targets, one a line

A TARGET is `<stage>-<stack>` (eval-cpu, eval-gpu, ...). GPU locks are resolved for the GPU base images'
interpreters even though they cannot run here. Packages that PyPI ships only as source (flash-attn, built
against the image's torch) sit in `<stage>/source-builds.txt`, hash-pinned; `check` downloads them too.

pip resolves, and picks each file and its hash, so the tool that installs the images also locks them, with the
host's pip configuration (find-links for local wheels). pip cannot override a dependency's declared range,
so a target with overrides (vLLM 0.33's stack, below) is resolved by uv (`pip install uv`) and hashed by pip.
A dependency no image can use as declared is replaced by one that installs the same modules (`REPLACED`:
RapidOCR's opencv-python by OpenCV's headless build).
`check` needs only pip: each file on the index at its hash, then the lock's closure walked from the inputs
through every wheel's own requirements (markers for the target's interpreter, extras followed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from packaging.requirements import Requirement

CONTAINERS = Path(__file__).resolve().parent
ROOT = CONTAINERS.parent
CPU_STACK_LOCK = ROOT / "requirements" / "cpu.txt"


@dataclass(frozen=True)
class Target:
    """One lock: which inputs, for which interpreter and platform."""

    stage: str
    stack: str
    python: str
    """Python version of the image's interpreter (python:3.11-slim and Debian bookworm: 3.11; vLLM's image: 3.12)."""
    platform: str
    """Most recent manylinux tag the image's glibc accepts (bookworm 2.36; Ubuntu 22.04 in the GPU images 2.35)."""
    follow_cpu_stack: bool
    """Constrain versions to requirements/cpu.txt (CPU images), so an image matches the CPU venv."""
    overrides: tuple[tuple[str, str, str], ...] = ()
    """(package, pinned version, why): a declared dependency range no release on the index satisfies, pinned
    anyway. pip cannot override a dependency, so such targets are resolved with uv's --override; images
    install every lock with --no-deps (the lock is complete) and `check` verifies closure itself."""

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.stack}"

    @property
    def source(self) -> Path:
        return CONTAINERS / self.stage / f"requirements.{self.stack}.in"

    @property
    def lock(self) -> Path:
        return CONTAINERS / self.stage / f"requirements.{self.stack}.lock"

    @property
    def source_builds(self) -> Path:
        return CONTAINERS / self.stage / "source-builds.txt"

    def pip_target_args(self) -> list[str]:
        # pip takes --platform tags literally: list every manylinux tag the image's glibc accepts, newest first.
        newest = int(re.fullmatch(r"manylinux_2_(\d+)_x86_64", self.platform).group(1))
        tags = [f"manylinux_2_{minor}_x86_64" for minor in range(newest, 16, -1)]
        tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
        abi = "cp" + self.python.replace(".", "")
        platforms = [arg for tag in tags for arg in ("--platform", tag)]
        # Always used with --no-deps, where pip allows these without --only-binary: a package with no wheel
        # for the platform is taken as its sdist (built in the image against the lock's setuptools).
        return ["--python-version", self.python, *platforms, "--implementation", "cp", "--abi", abi]


REPLACED: tuple[tuple[str, str, str], ...] = (
    ("opencv-python", "opencv-python-headless",
     ("OpenCV without its GUI: opencv-python links libGL, GLib and X11, which the slim and vLLM bases lack, and "
      "vLLM pins the headless build, which a second cv2 would overwrite; RapidOCR declares opencv-python")),
)
"""(dependency, replacement, why), in every image: the dependency is left out of resolution (uv's --excludes)
and the replacement, which installs the same modules, stands in for it. A lock that needs it names the
replacement in its inputs; CPU locks take the dependency's requirements/cpu.txt version for the replacement,
and `check` counts the replacement's version against requirements on the dependency."""
VLLM_OVERRIDES: tuple[tuple[str, str, str], ...] = ()
"""vLLM 0.32.0's declared ranges all resolve on the index (0.33.0 needed a certifi pin)."""
CPU = {"python": "3.11", "platform": "manylinux_2_36_x86_64", "follow_cpu_stack": True}
TARGETS = {
    t.name: t
    for t in (
        Target("synth", "cpu", **CPU),
        Target("sft", "cpu", **CPU),
        Target("rl", "cpu", **CPU),
        Target("eval", "cpu", **CPU),
        # LLaMA-Factory's image runs Python 3.11; vLLM's runs 3.12. Both are Ubuntu 22.04 (glibc 2.35).
        Target("sft", "gpu", python="3.11", platform="manylinux_2_35_x86_64", follow_cpu_stack=False),
        Target("rl", "gpu", python="3.12", platform="manylinux_2_35_x86_64", follow_cpu_stack=False,
               overrides=VLLM_OVERRIDES),
        Target("eval", "gpu", python="3.12", platform="manylinux_2_35_x86_64", follow_cpu_stack=False,
               overrides=VLLM_OVERRIDES),
    )
}

_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;#\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def input_files(target: Target) -> list[Path]:
    """The .in file and every file it includes with -r, in order."""
    files, todo = [], [target.source]
    while todo:
        path = todo.pop(0)
        files.append(path)
        for line in path.read_text().splitlines():
            if line.strip().startswith("-r "):
                todo.append((path.parent / line.strip()[3:].strip()).resolve())
    return files


def inputs_digest(target: Target) -> str:
    """A hash of the .in files the lock was resolved from; the lock records it so staleness shows offline.
    requirements/cpu.txt is left out (others edit it for the venv): the tests compare the CPU locks' versions
    with it instead, package by package."""
    digest = hashlib.sha256()
    for path in input_files(target):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def recorded_digest(lock: Path) -> str | None:
    match = re.search(r"^# inputs: ([0-9a-f]+)$", lock.read_text(), re.MULTILINE)
    return match.group(1) if match else None


def read_lock(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [sha256 hashes])} of a lock file (or a source-builds file)."""
    text = lock.read_text().replace("\\\n", " ")
    pins: dict[str, tuple[str, list[str]]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN.match(line)
        if not match:
            raise ValueError(f"{lock}: line {number}: not a `name==version --hash=sha256:...` pin: {line!r}")
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
        pins[canonical(match.group(1))] = (match.group(3), hashes)
    return pins


def _pip(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    return subprocess.run([sys.executable, "-m", "pip", *args], text=True, capture_output=True, env=env, check=False,
                          **kwargs)


def _constraints(target: Target, workdir: Path) -> list[str]:
    """requirements/cpu.txt less the packages the target pins itself (the CPU-only torch overrides 2.14.1)."""
    if not target.follow_cpu_stack:
        return []
    own = set()
    for path in input_files(target):
        for line in path.read_text().splitlines():
            match = _PIN.match(line.strip())
            if match:
                own.add(canonical(match.group(1)))
    kept = [line for line in CPU_STACK_LOCK.read_text().splitlines()
            if not (m := _PIN.match(line.strip())) or canonical(m.group(1)) not in own]
    # A replacement at the version the venv has of what it replaces (opencv-python-headless at opencv-python's).
    venv = {canonical(m.group(1)): m.group(3) for line in kept if (m := _PIN.match(line.strip()))}
    kept += [f"{replacement}=={venv[dependency]}" for dependency, replacement, _ in REPLACED
             if dependency in venv and replacement not in venv and replacement not in own]
    path = workdir / "constraints.txt"
    path.write_text("\n".join(kept) + "\n")
    return ["-c", str(path)]


def _sha256_of(url: str) -> str:
    path = Path(unquote(urlparse(url).path))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _select_files(target: Target, requirement_args: list[str], workdir: Path) -> list[dict]:
    """The files pip would install, without dependencies, for the target's interpreter and platform: the
    `install` items of its --dry-run report (url, hash and each wheel's metadata)."""
    report = workdir / "report.json"
    result = _pip(["install", "--dry-run", "--ignore-installed", "--no-deps", "--quiet", "--report", str(report),
                   *target.pip_target_args(), *requirement_args])
    if result.returncode != 0:
        raise RuntimeError(f"{target.name}: pip could not resolve:\n{result.stderr.strip()[-3000:]}")
    return json.loads(report.read_text())["install"]


def _find_links() -> list[str]:
    """pip's configured find-links (local wheels such as the CPU-only torch), handed to uv too."""
    result = _pip(["config", "list"])
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    links += [v.strip("'") for k, v in (line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
              if k.endswith("find-links")]
    return [arg for link in dict.fromkeys(links) for arg in ("--find-links", link)]


def resolve_versions(target: Target, workdir: Path, upgrade: bool = False) -> dict[str, str]:
    """{name: version} resolving target's inputs, by uv (from PATH: `pip install uv`).

    The current lock's versions are preferred (uv keeps what an existing output file pins wherever the inputs
    allow), so adding a package moves nothing else; `upgrade` resolves afresh, to the newest the inputs allow.

    uv rather than pip's resolver: pip needs --only-binary=:all: to resolve for another interpreter or
    platform, which rules out source-only dependencies (LLaMA-Factory's omegaconf needs antlr4's sdist),
    and pip cannot override a dependency's declared range (the vLLM targets' `overrides`).
    """
    uv = shutil.which("uv")
    if uv is None:
        raise RuntimeError("locking needs uv on PATH (`pip install uv`); checking and fetching need only pip")
    overrides = workdir / "overrides.txt"
    overrides.write_text("".join(f"{name}=={version}\n" for name, version, _ in target.overrides))
    excludes = workdir / "excludes.txt"
    excludes.write_text("".join(f"{dependency}\n" for dependency, _, _ in REPLACED))
    out = workdir / "resolved.txt"
    if not upgrade and target.lock.is_file():
        out.write_text("".join(f"{name}=={version}\n" for name, (version, _) in read_lock(target.lock).items()))
    result = subprocess.run(
        [uv, "pip", "compile", str(target.source), "--overrides", str(overrides), "--excludes", str(excludes),
         "--python-version",
         target.python, "--python-platform", f"x86_64-{target.platform.removesuffix('_x86_64')}", "--no-header",
         "--quiet", "--no-annotate", "--output-file", str(out), *_find_links(), *_constraints(target, workdir)],
        text=True, capture_output=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{target.name}: uv could not resolve:\n{result.stderr.strip()[-3000:]}")
    return {canonical(m.group(1)): m.group(3) for line in out.read_text().splitlines() if (m := _PIN.match(line))}


def lock(target: Target, upgrade: bool = False) -> Path:
    """Resolve target's inputs and write its lock file: each package's version and the hash of its file
    (the current lock's versions kept where the inputs allow, unless `upgrade`)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pins = resolve_versions(target, work, upgrade)
        # pip picks the one file it would install for the image's interpreter and platform.
        items = _select_files(target, [f"{name}=={version}" for name, version in pins.items()], work)
    lines = [
        f"# Generated by `python containers/locks.py lock {target.name}` from {target.source.name}; do not edit.",
        f"# For CPython {target.python} on {target.platform}; install with --require-hashes --no-deps.",
        *(f"# override: {name}=={version} ({why})" for name, version, why in target.overrides),
        *(f"# replaced: {dependency} by {replacement} (containers/locks.py REPLACED)"
          for dependency, replacement, _ in REPLACED if replacement in pins),
        f"# inputs: {inputs_digest(target)}",
    ]
    for item in sorted(items, key=lambda i: canonical(i["metadata"]["name"])):
        info = item["download_info"]
        sha = info.get("archive_info", {}).get("hashes", {}).get("sha256") or _sha256_of(info["url"])
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha}")
    target.lock.write_text("\n".join(lines) + "\n")
    return target.lock


def _roots(target: Target) -> list[Requirement]:
    roots = []
    for path in input_files(target):
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line and not line.startswith("-"):
                roots.append(Requirement(line))
    return roots


def unmet_requirements(target: Target, metadata: dict[str, dict]) -> list[str]:
    """Every requirement reachable from the target's inputs that the locked versions do not satisfy.

    `metadata` maps each locked package to its wheel's metadata (pip's report); markers are evaluated for the
    target's interpreter on x86_64 Linux, extras followed where a requirement asks for them.
    """
    env = {"python_version": target.python, "python_full_version": f"{target.python}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython"}
    overridden = {canonical(name): version for name, version, _ in target.overrides}
    standing_in = {canonical(dependency): canonical(replacement) for dependency, replacement, _ in REPLACED}
    problems, seen = [], set()
    # (requirement, who wants it, whether its marker still needs evaluating): a dependency reached through an
    # extra had its marker (`extra == "..."`) evaluated with that extra already.
    todo = [(r, str(target.source.name), True) for r in _roots(target)]
    while todo:
        req, wanted_by, evaluate = todo.pop()
        if evaluate and req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        name = canonical(req.name)
        if name not in metadata and standing_in.get(name) in metadata:
            name = standing_in[name]  # the replacement's version is checked against the dependency's range
        if name not in metadata:
            problems.append(f"{wanted_by} needs {req}, which the lock lacks")
            continue
        version = metadata[name]["version"]
        if not req.specifier.contains(version, prereleases=True) and overridden.get(name) != version:
            problems.append(f"{wanted_by} needs {req}, the lock has {name}=={version}")
        for extra in ["", *sorted(req.extras)]:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for dep in map(Requirement, metadata[name].get("requires_dist") or []):
                in_scope = dep.marker is None or dep.marker.evaluate({**env, "extra": extra})
                if in_scope and (extra == "" or dep.marker is not None):
                    todo.append((dep, f"{name}=={version}", False))
    return problems


def check(target: Target) -> list[str]:
    """Problems with target's lock ([] when every file is on its index at its hash and the lock is closed)."""
    if not target.lock.is_file():
        return [f"{target.lock}: missing (run `python containers/locks.py lock {target.name}`)"]
    problems = []
    if recorded_digest(target.lock) != inputs_digest(target):
        problems.append(f"{target.lock}: stale, its inputs changed "
                        f"(run `python containers/locks.py lock {target.name}`)")
    pins = read_lock(target.lock)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            # Every pinned file must be on the index for this platform with exactly the recorded hash.
            items = _select_files(target, ["--require-hashes", "-r", str(target.lock)], Path(tmp))
        except RuntimeError as err:
            return problems + [str(err)]
    metadata = {canonical(i["metadata"]["name"]): i["metadata"] for i in items}
    for name, (version, _) in pins.items():
        if name not in metadata or metadata[name]["version"] != version:
            problems.append(f"{target.lock}: {name}=={version} resolved as {metadata.get(name, {}).get('version')}")
    # Closure: the wheels' own requirements, walked from the inputs, are all met by the locked versions.
    problems += [f"{target.lock}: {p}" for p in unmet_requirements(target, metadata)]
    if target.source_builds.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            result = _pip(["download", "--no-deps", "--no-binary=:all:", "--no-build-isolation", "--require-hashes",
                           "--quiet", "-d", tmp, "-r", str(target.source_builds)])
        if result.returncode != 0:
            problems.append(f"{target.source_builds}: {result.stderr.strip()[-2000:]}")
    return problems


def fetch(target: Target, dest: Path) -> Path:
    """Download target's wheels into dest (files already there are reused)."""
    dest.mkdir(parents=True, exist_ok=True)
    result = _pip(["download", "--no-deps", "--require-hashes", "--quiet", "-d", str(dest),
                   *target.pip_target_args(), "-r", str(target.lock)])
    if result.returncode != 0:
        raise RuntimeError(f"{target.name}: pip download failed:\n{result.stderr.strip()[-3000:]}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="containers/locks.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("lock", "check"):
        cmd = sub.add_parser(name)
        cmd.add_argument("targets", nargs="*", help="default: every target")
        if name == "lock":
            cmd.add_argument("--upgrade", action="store_true",
                             help="resolve afresh (by default the current lock's versions are kept where they fit)")
    fetch_cmd = sub.add_parser("fetch")
    fetch_cmd.add_argument("target", choices=list(TARGETS))
    fetch_cmd.add_argument("--dest", type=Path, required=True)
    sub.add_parser("list")
    args = parser.parse_args(argv)

    if args.command == "list":
        print("\n".join(TARGETS))
        return 0
    if args.command == "fetch":
        print(fetch(TARGETS[args.target], args.dest))
        return 0
    unknown = [name for name in args.targets if name not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; targets: {', '.join(TARGETS)}")
    failed = False
    for name in args.targets or list(TARGETS):
        target = TARGETS[name]
        if args.command == "lock":
            path = lock(target, args.upgrade)
            print(f"{name}: {len(read_lock(path))} packages -> {path.relative_to(ROOT)}")
        else:
            problems = check(target)
            failed |= bool(problems)
            print(f"{name}: " + ("ok" if not problems else "\n  ".join(["FAILED", *problems])))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
