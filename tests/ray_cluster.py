"""A two-node Ray cluster on this machine, for the rl stage's cluster test (tests/test_rl_cluster.py).

Two `ray start --block` processes, a head and a worker node, each started from its own working directory with
its own temp dir, custom resources and free ports, so that:

- actors land on both nodes when their resources say so (each node gets its own custom resource);
- an actor's working directory is its node's, not the driver's (a relative path that reaches an actor fails
  as it would on a real cluster);
- nothing collides with another Ray on the machine (other test runs, other users): every port is picked
  free, usage stats and the dashboard are off.

Stopping never runs `ray stop`, which kills every Ray on the machine. `--block` keeps each node's
`ray start` in the foreground as our child: SIGTERM to it shuts its node down (Ray's `Node` registers the
shutdown at exit when blocking, ray/scripts/scripts.py `start`), and a sweep then kills, by pid, whatever
process still names one of this cluster's temp dirs on its command line (raylet, GCS, agents and workers all
do), so a node that did not shut down cleanly leaves nothing behind either.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
"""The `ray` script of this interpreter's environment: nodes run the same Python and packages as the tests."""


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free now (bound together, so none repeats)."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in sockets]


def _node_ports() -> list[str]:
    """Flags giving one node's servers free ports (Ray's defaults, 6379, 10001, 52365, ..., would collide)."""
    agent, grpc, metrics, runtime_env, node_manager, object_manager = free_ports(6)
    return [
        f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={grpc}",
        f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={runtime_env}",
        f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
    ]


@dataclass
class RayNode:
    """One `ray start --block` process and where it runs."""

    name: str
    cwd: Path
    temp_dir: Path
    process: subprocess.Popen
    log: Path


@dataclass
class RayCluster:
    """A running cluster: its GCS address (for RAY_ADDRESS), nodes, and the folder holding all of it."""

    address: str
    root: Path
    nodes: list[RayNode] = field(default_factory=list)
    start_seconds: float = 0.0
    """How long the cluster took to come up (both nodes listed alive by the GCS)."""

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """Stop every node by its pid, then kill any process still naming one of our temp dirs; returns the
        pids the sweep had to kill (empty when every node shut down cleanly)."""
        for node in reversed(self.nodes):  # worker nodes first, the head last
            if node.process.poll() is None:
                node.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node in self.nodes:
            try:
                node.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.process.kill()
                node.process.wait()
        swept = self._sweep(deadline)
        return swept

    def _sweep(self, deadline: float) -> list[int]:
        marks = [str(node.temp_dir) for node in self.nodes]
        pids = processes_naming(marks)
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        while time.monotonic() < deadline and processes_naming(marks):
            time.sleep(0.2)
        for pid in processes_naming(marks):
            _signal(pid, signal.SIGKILL)
        return pids

    def driver_env(self) -> dict[str, str]:
        """The environment of a driver that joins this cluster through RAY_ADDRESS."""
        return {**_clean_env(), "RAY_ADDRESS": self.address}

    def logs(self, tail: int = 4000) -> str:
        """The end of each node's `ray start` output (for a failing test's message)."""
        parts = []
        for node in self.nodes:
            text = node.log.read_text(encoding="utf-8", errors="replace") if node.log.exists() else ""
            parts.append(f"--- {node.name} ({node.log}) ---\n{text[-tail:]}")
        return "\n".join(parts)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def processes_naming(marks: list[str]) -> list[int]:
    """Pids of this user's processes whose command line contains one of `marks` (read from /proc)."""
    found = []
    me = os.getuid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != me:
                continue
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(mark in cmdline for mark in marks):
            found.append(int(entry.name))
    return found


def _start_node(name: str, root: Path, args: list[str], env: dict[str, str]) -> RayNode:
    cwd = root / name
    cwd.mkdir(parents=True, exist_ok=True)
    # Short and unique: Ray puts Unix sockets under the temp dir, and a socket path is limited to 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix=f"lray{name[0]}-", dir="/tmp"))
    log = root / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [RAY, "start", "--block", f"--temp-dir={temp_dir}", "--disable-usage-stats", *_node_ports(), *args],
            cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    return RayNode(name, cwd, temp_dir, process, log)


def _wait_for_nodes(cluster: RayCluster, count: int, timeout_s: float) -> None:
    """Until the GCS lists `count` live nodes (asked from a child process: this one must not join Ray)."""
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.monotonic() + timeout_s
    alive = 0
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            if node.process.poll() is not None:
                raise RuntimeError(f"ray node {node.name} exited with {node.process.returncode}\n{cluster.logs()}")
        done = subprocess.run([sys.executable, "-c", probe, cluster.address], check=False, capture_output=True, text=True,
                              env=_clean_env(), cwd=cluster.root, timeout=max(5.0, deadline - time.monotonic()))
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        alive = done.stdout.strip()
        time.sleep(1.0)
    raise RuntimeError(f"ray cluster: {alive} of {count} nodes alive after {timeout_s} s\n{cluster.logs()}")


def _clean_env() -> dict[str, str]:
    """This environment without anything that would make a node or probe join another Ray, and with Ray's
    token authentication off.

    Ray 2.5x turns token authentication on for a new cluster whenever ~/.ray/auth_token exists (any local
    `ray.init()` on the machine writes one), while a driver joining by address only sends the token when
    RAY_AUTH_MODE=token (ray/_private/authentication/authentication_token_setup.py,
    `maybe_enable_token_auth_if_token_available`): nodes and drivers say `disabled` explicitly so the test
    does not depend on what another process left in the home directory.
    """
    return {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, "RAY_AUTH_MODE": "disabled"}


def start_cluster(
    root: Path,
    head_resources: dict[str, float],
    worker_resources: dict[str, float],
    num_cpus: int = 2,
    env: dict[str, str] | None = None,
    timeout_s: float = 90.0,
) -> RayCluster:
    """A head and one worker node under `root` (their working directories `root/head` and `root/worker`).

    Both nodes report 0 GPUs (tests run on CPU even on a machine with a GPU) and `num_cpus` CPUs. `env` is
    added to the nodes' environment (the environment of `ray start`, which actors inherit).
    """
    root.mkdir(parents=True, exist_ok=True)
    node_env = {**_clean_env(), **(env or {})}
    started = time.monotonic()
    gcs_port, client_port, dashboard_port = free_ports(3)
    cluster = RayCluster(address=f"127.0.0.1:{gcs_port}", root=root)
    try:
        cluster.nodes.append(_start_node("head", root, [
            "--head", f"--port={gcs_port}", f"--ray-client-server-port={client_port}", "--include-dashboard=false",
            f"--dashboard-port={dashboard_port}",  # a head starts its dashboard process even so, on 8265 by default
            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--resources={json.dumps(head_resources)}",
        ], node_env))
        _wait_for_nodes(cluster, 1, timeout_s)
        cluster.nodes.append(_start_node("worker", root, [
            f"--address={cluster.address}", f"--num-cpus={num_cpus}", "--num-gpus=0",
            f"--resources={json.dumps(worker_resources)}",
        ], node_env))
        _wait_for_nodes(cluster, 2, timeout_s)
        cluster.start_seconds = time.monotonic() - started
    except BaseException:
        cluster.stop()
        remove_temp_dirs(cluster)
        raise
    return cluster


def remove_temp_dirs(cluster: RayCluster) -> None:
    """Delete the nodes' temp dirs (under /tmp, outside pytest's tmp_path) once the cluster is stopped."""
    for node in cluster.nodes:
        shutil.rmtree(node.temp_dir, ignore_errors=True)
