"""The rl stage on a Ray cluster: what actors inherit, where they are placed, and which paths they may read.

Three things differ between a local Ray (started by this process) and a cluster joined with RAY_ADDRESS, and
each breaks on a cluster a run that works locally:

- **Environment.** A local Ray's raylet is forked from the driver, so actors inherit the driver's whole
  environment; on a cluster they inherit the environment of `ray start` on their node. `passed_environment`
  picks what the driver hands every actor through the job's `runtime_env` (`start_ray`): behaviour settings of
  the libraries the actors run (NCCL, gloo, torch, Hugging Face, vLLM, OpenMP, Loupe), never secrets and
  never what Ray sets per actor or what describes one node's installation.
- **Placement.** `learner_placement` reserves the learner's GPUs as one STRICT_PACK placement group per node
  (a node's ranks are never split across nodes), `worker_placement` the rollout workers' bundles; both wait
  `rl.ray.placement_timeout_s` and then fail with what was asked and what the cluster has, instead of
  leaving the stage pending forever on a request no node can meet.
- **Paths.** An actor's working directory is its node's (where `ray start` ran), not the driver's: a relative
  path names another file there, or none. The driver makes every input absolute before an actor sees it
  (`absolute_path`, `absolute_params`), and each actor checks at start that its paths exist on its node
  (`require_on_node`), so a node without the shared filesystem fails at once, naming itself.

Upstream: verl reserves one STRICT_PACK placement group per node and sorts them by node IP so ranks keep
their order across restarts (volcengine/verl, verl/single_controller/ray/base.py: `RayResourcePool.
get_placement_groups`, `sort_placement_group_by_node_ip`); it waits on `pg.ready()` without a timeout and
checks GPU totals up front (`ResourcePoolManager._check_resource_available`). OpenRLHF puts all ranks in one
PACK group (OpenRLHF/OpenRLHF, openrlhf/trainer/ray/launcher.py: `RayActorGroup._initiate_actors`), also
without a timeout. verl passes a fixed set of variables in the job's runtime_env and leaves out those the
user already set (verl/trainer/constants_ppo.py: `PPO_RAY_RUNTIME_ENV`, `get_ppo_ray_runtime_env`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stages.rl.params import RayParams, RLParams

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


# --- the environment actors inherit ------------------------------------------------------------------------

PASSED_PREFIXES = (
    "NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "TORCHDYNAMO_", "PYTORCH_", "CUDA_",
    "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TOKENIZERS_", "VLLM_",
    "OMP_", "MKL_", "OPENBLAS_", "ONEDNN_", "ATEN_", "LOUPE_", "MLFLOW_",
)
"""Prefixes of variables passed to actors: settings of the collectives (NCCL_SOCKET_IFNAME, NCCL_DEBUG,
GLOO_SOCKET_IFNAME, TORCH_NCCL_*), of torch (TORCH_*, PYTORCH_CUDA_ALLOC_CONF, CUDA_LAUNCH_BLOCKING), of the
Hugging Face libraries (HF_HUB_OFFLINE, HF_HOME, TRANSFORMERS_OFFLINE, TOKENIZERS_PARALLELISM), of vLLM, of
the CPU thread pools and kernel sets (OMP_NUM_THREADS, MKL_NUM_THREADS, MKL_ENABLE_INSTRUCTIONS,
ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY) and of Loupe and MLflow themselves."""

PASSED_NAMES = ("PYTHONHASHSEED",)
"""Variables passed by exact name."""

NODE_LOCAL = ("CUDA_HOME", "CUDA_PATH", "VLLM_HOST_IP", "VLLM_PORT")
"""Never passed although a prefix matches: they describe one node (its CUDA install, its own address), and the
driver's value would be wrong on the others."""

NODE_LOCAL_SUFFIXES = ("_VISIBLE_DEVICES",)
"""Never passed: Ray sets CUDA_VISIBLE_DEVICES (and ROCR_/HIP_/NEURON_RT_VISIBLE_...) for each actor from the GPUs
it was given; the driver's value would make every actor see the driver's GPUs instead of its own."""

SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
"""A name containing one of these (any case) is a secret and is never passed, whatever rule or `pass_env`
entry matches it. The job's runtime_env is stored with the job in the cluster's GCS, where any client of the
cluster reads it back (checked on Ray 2.60: `GcsClient.get_all_job_info()` returns it in the job's
`config.runtime_env_info`, the job table the dashboard and state API show), and every process of the job gets
it. A judge's API key (OPENAI_API_KEY), HF_TOKEN or MLFLOW_TRACKING_PASSWORD belongs in the environment of
`ray start` on each node (actors inherit that), not in the job's configuration."""

NOT_SECRETS = ("TOKENIZERS_PARALLELISM", "NCCL_IB_PKEY", "HF_HUB_DISABLE_IMPLICIT_TOKEN")
"""Settings whose names merely contain a secret word (a tokenizer switch, an InfiniBand partition number, a
flag that stops sending a token): passed."""


def is_secret(name: str) -> bool:
    """Whether `name` looks like it holds a secret (see `SECRET_WORDS`)."""
    upper = name.upper()
    return upper not in NOT_SECRETS and any(word in upper for word in SECRET_WORDS)


def _named(name: str, patterns: Iterable[str]) -> bool:
    """Whether `name` matches one of `patterns`: exact names, or prefixes ending in `*`."""
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def passed_environment(extra: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of this process handed to every actor through the job's runtime_env.

    The rule: a variable passes when its name starts with one of `PASSED_PREFIXES`, is one of `PASSED_NAMES`,
    or matches `extra` (rl.ray.pass_env: names, or prefixes ending in `*`); and it is dropped when it is
    node-local (`NODE_LOCAL`, `NODE_LOCAL_SUFFIXES`: Ray's per-actor device lists, one node's install or
    address), a secret (`is_secret`), or empty. Ray's own RAY_* variables are not passed (they configure
    the driver's connection, not the actors).

    The driver's values override those of `ray start` on a node for the variables passed: a run's settings
    (NCCL_DEBUG=INFO for one run) are the driver's to make. What is not passed comes from `ray start`.
    """
    environ = os.environ if environ is None else environ
    extra = tuple(extra)
    passed = {}
    for name, value in environ.items():
        wanted = name.startswith(PASSED_PREFIXES) or name in PASSED_NAMES or _named(name, extra)
        local = name in NODE_LOCAL or name.endswith(NODE_LOCAL_SUFFIXES) or name.startswith("RAY_")
        if wanted and value and not local and not is_secret(name):
            passed[name] = value
    return passed


def start_ray(params: RayParams) -> bool:
    """Join the cluster the address variable names, or start a local one; True when this call started Ray.

    Either way the job's runtime_env carries `passed_environment(params.pass_env)`, so actors on every node
    run with the driver's settings (on a local Ray they would inherit them anyway; on a cluster they would
    not). An actor's own runtime_env env_vars are merged over the job's by Ray.

    Without the variable the local Ray is asked for by name (`address="local"`): a bare `ray.init()` would
    join whatever cluster the last `ray start` on this machine recorded in /tmp/ray/ray_current_cluster
    (ray/_private/services.py: `get_ray_address_from_environment`), someone else's included, and then refuse
    `num_cpus`.
    """
    import ray

    if ray.is_initialized():
        return False
    runtime_env = {"env_vars": passed_environment(params.pass_env)}
    address = os.environ.get(params.address_env)
    if address:
        ray.init(address=address, runtime_env=runtime_env)
    else:
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, runtime_env=runtime_env)
    return True


# --- placement ---------------------------------------------------------------------------------------------


class PlacementError(RuntimeError):
    """A placement the cluster did not meet within the timeout (the message says what was asked and found)."""


@dataclass
class Placement:
    """Reserved bundles, one per actor, in rank order; `actor_options(i)` schedules actor i into bundle i."""

    groups: list[PlacementGroup]
    bundles: list[dict[str, float]]
    """The bundle of each slot, in slot order (slot i is bundle i % per_group of group i // per_group)."""
    per_group: int
    what: str = "actors"
    _removed: bool = field(default=False, repr=False)

    def __len__(self) -> int:
        return len(self.bundles)

    def strategy(self, index: int) -> PlacementGroupSchedulingStrategy:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, bundle = divmod(index, self.per_group)
        return PlacementGroupSchedulingStrategy(self.groups[group], placement_group_bundle_index=bundle)

    def actor_options(self, index: int) -> dict[str, Any]:
        """`.options(...)` for the actor of slot `index`: exactly its bundle's resources, scheduled into it."""
        bundle = dict(self.bundles[index])
        options: dict[str, Any] = {
            "num_cpus": bundle.pop("CPU", 0),
            "num_gpus": bundle.pop("GPU", 0),
            "scheduling_strategy": self.strategy(index),
        }
        if bundle:
            options["resources"] = bundle
        return options

    def node_ips(self) -> list[str]:
        """The IP of the node holding each slot."""
        import ray
        from ray.util import placement_group_table

        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        out = []
        for index in range(len(self)):
            group, bundle = divmod(index, self.per_group)
            out.append(ips.get(placement_group_table(self.groups[group])["bundles_to_node_id"][bundle], "?"))
        return out

    def remove(self) -> None:
        """Give the reserved resources back (after the actors in them are killed)."""
        if self._removed:
            return
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)
        self._removed = True


def _bundle(cpus: float, gpus: float, resources: Mapping[str, float] | None) -> dict[str, float]:
    """A bundle without zero entries (Ray rejects a bundle resource of 0)."""
    bundle = {"CPU": float(cpus), "GPU": float(gpus), **{k: float(v) for k, v in (resources or {}).items()}}
    return {k: v for k, v in bundle.items() if v > 0}


def _reserve(groups: list[list[dict[str, float]]], strategy: str, timeout_s: float, what: str, asked: str) -> list[PlacementGroup]:
    """Create the groups and wait for all of them; on timeout remove them and raise `PlacementError`."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    created = [placement_group(bundles, strategy=strategy) for bundles in groups]
    try:
        ray.get([group.ready() for group in created], timeout=timeout_s)
    except GetTimeoutError:
        for group in created:
            remove_placement_group(group)
        keys = sorted({k for bundles in groups for bundle in bundles for k in bundle})
        raise PlacementError(
            f"rl.ray: could not place the {what} within {timeout_s:g} s (rl.ray.placement_timeout_s): asked for "
            f"{asked}; {_cluster_report(keys)}"
        ) from None
    return created


def _fmt(value: float) -> str:
    return f"{value:g}"


def _cluster_report(keys: list[str]) -> str:
    """What the cluster has of the resources in `keys`: in all, free now, and per node."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()

    def amounts(have: Mapping[str, float], of: Mapping[str, float] | None = None) -> str:
        if of is None:
            return ", ".join(f"{k} {_fmt(have.get(k, 0))}" for k in keys)
        return ", ".join(f"{k} {_fmt(have.get(k, 0))}/{_fmt(of.get(k, 0))}" for k in keys)

    try:  # private, but the only per-node view of free resources (verl's _check_resource_available uses it)
        from ray._private.state import available_resources_per_node

        free_per_node = available_resources_per_node()
    except Exception:  # noqa: BLE001 - an older or newer Ray without it: report totals only
        free_per_node = {}
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        name = f"{node.get('NodeManagerAddress')} ({node.get('NodeManagerHostname', '?')})"
        if node["NodeID"] in free_per_node:
            nodes.append(f"{name}: {amounts(free_per_node[node['NodeID']], have)}")
        else:
            nodes.append(f"{name}: {amounts(have)} in all")
    return (
        f"the cluster has {amounts(free, total)} (free/total); per node (free/total): "
        + "; ".join(nodes)
        + ". Ask for what the nodes have (rl.ray.gpus_per_node, nodes, num_workers, cpus_per_worker, "
        "gpus_per_worker, worker_resources, learner_resources), add nodes, or raise rl.ray.placement_timeout_s "
        "if nodes are still joining."
    )


def _describe(bundle: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in bundle.items()) + "}"


def _totals(bundles: list[dict[str, float]]) -> str:
    keys = sorted({k for b in bundles for k in b})
    return ", ".join(f"{k} {_fmt(sum(b.get(k, 0) for b in bundles))}" for k in keys)


def learner_placement(
    nodes: int,
    gpus_per_node: int,
    cpus_per_rank: float,
    timeout_s: float,
    resources: Mapping[str, float] | None = None,
    gpus_per_rank: float = 1.0,
) -> Placement:
    """Reserve the learner ranks: `nodes` STRICT_PACK groups of `gpus_per_node` bundles each, rank order by node.

    Each bundle is {"GPU": gpus_per_rank, "CPU": cpus_per_rank, **resources}; `gpus_per_rank` 0 gives CPU
    ranks (the gloo tests). STRICT_PACK puts a group's bundles on one node, so the ranks of a node are never
    split (FSDP's collectives stay on NVLink within a node); two groups may share a node that has room for
    both, which is only faster. Groups are ordered by node IP, so the same cluster gives the same rank order
    on every run (verl/single_controller/ray/base.py: `RayResourcePool.get_placement_groups`,
    `sort_placement_group_by_node_ip`). The wait is bounded: after `timeout_s` the groups are removed and a
    `PlacementError` names the bundles asked and what each node has.
    """
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"learner placement: nodes ({nodes}) and ranks per node ({gpus_per_node}) must be at least 1")
    bundle = _bundle(cpus_per_rank, gpus_per_rank, resources)
    groups = [[dict(bundle) for _ in range(gpus_per_node)] for _ in range(nodes)]
    asked = (
        f"{nodes} node(s) x {gpus_per_node} bundle(s) {_describe(bundle)} (STRICT_PACK: each node's bundles on one "
        f"node), {_totals([b for g in groups for b in g])} in all"
    )
    created = _reserve(groups, "STRICT_PACK", timeout_s, "learner", asked)
    created = _by_node_ip(created)
    return Placement(created, [b for g in groups for b in g], gpus_per_node, "learner")


def _by_node_ip(groups: list[PlacementGroup]) -> list[PlacementGroup]:
    """Groups sorted by the IP (then id) of the node holding them (verl's `sort_placement_group_by_node_ip`)."""
    import ray
    from ray.util import placement_group_table

    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}

    def key(group: PlacementGroup) -> tuple[str, str]:
        node = placement_group_table(group)["bundles_to_node_id"][0]
        return ips.get(node, ""), node

    return sorted(groups, key=key)


def worker_placement(
    num_workers: int,
    cpus_per_worker: float,
    gpus_per_worker: float,
    timeout_s: float,
    resources: Mapping[str, float] | None = None,
) -> Placement:
    """Reserve one bundle per rollout worker ({"CPU", "GPU": gpus_per_worker, **resources}) in one PACK group.

    PACK fills nodes in turn but spreads when it must: custom resources that each node advertises once
    (`ray start --resources '{"rollout_slot": 1}'` with `rl.ray.worker_resources: {rollout_slot: 1}`) put
    one worker on each node. Reserving before creating the actors separates "cannot be scheduled" (a
    `PlacementError` after `timeout_s`) from "is slow to start" (an engine loading a large model, which no
    timeout here cuts short).
    """
    if num_workers < 1:
        raise ValueError(f"worker placement: num_workers ({num_workers}) must be at least 1")
    bundle = _bundle(cpus_per_worker, gpus_per_worker, resources)
    bundles = [dict(bundle) for _ in range(num_workers)]
    asked = f"{num_workers} bundle(s) {_describe(bundle)} (PACK), {_totals(bundles)} in all"
    created = _reserve([bundles], "PACK", timeout_s, "rollout workers", asked)
    return Placement(created, bundles, num_workers, "rollout workers")


# --- paths -------------------------------------------------------------------------------------------------

SHARED_FS_HINT = (
    "rl actors read inputs by absolute path, so every node needs the same shared filesystem at the same mount "
    "point (NFS, Lustre, a cloud file store mounted alike everywhere; or copies at the same path on each node)"
)


def absolute_path(path: str | os.PathLike[str]) -> Path:
    """`path` made absolute against the driver's working directory, `~` expanded, `..` folded.

    Symlinks are kept, not resolved: a symlink on the shared filesystem may point at a mount only the driver's
    node has (an automounter's per-host path), while the name the user gave is the one every node mounts.
    """
    return Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


def absolute_custom_reward(spec: str | None) -> str | None:
    """A custom reward 'path/to/file.py:function' with its file made absolute (`absolute_path`)."""
    if not spec:
        return spec
    path, sep, name = spec.rpartition(":")
    if not sep or not path:  # malformed: load_custom_reward reports it
        return spec
    return f"{absolute_path(path)}:{name}"


def absolute_params(params: RLParams) -> RLParams:
    """`params` with every path an actor reads made absolute: the custom reward's file, the judge's and the
    remote reward model's caches and the critic's starting model."""
    updates: dict[str, Any] = {}
    if params.critic.path:
        updates["critic"] = params.critic.model_copy(update={"path": str(absolute_path(params.critic.path))})
    if params.custom_reward:
        updates["custom_reward"] = absolute_custom_reward(params.custom_reward)
    remote = params.remote_reward
    if remote is not None and remote.cache_dir:
        updates["remote_reward"] = remote.model_copy(update={"cache_dir": str(absolute_path(remote.cache_dir))})
    judge = params.reward.judge
    if judge is not None and judge.cache_dir:
        judge = judge.model_copy(update={"cache_dir": str(absolute_path(judge.cache_dir))})
        updates["reward"] = params.reward.model_copy(update={"judge": judge})
    return params.model_copy(update=updates) if updates else params


def reward_paths(custom_reward: str | None) -> dict[str, str]:
    """The paths the reward pool must find, named for `require_on_node`: the custom reward's file.

    The judge's cache directory is not among them: the judge creates it when it writes its first verdict,
    so a first run has none to find, and a node that writes to a cache of its own costs repeated judge calls,
    never a wrong reward. `absolute_params` still makes it absolute, so every node writes the same cache when
    the filesystem is shared.
    """
    if not custom_reward:
        return {}
    path, sep, _ = custom_reward.rpartition(":")
    return {"rl.custom_reward": path} if sep and path else {}


def node_name() -> str:
    """'<ip> (<hostname>)' of this node: Ray's view of its IP when Ray runs here, else the hostname's."""
    host = socket.gethostname()
    try:
        import ray

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostbyname(host)
    except Exception:  # noqa: BLE001 - a name for a message; never fail over it
        ip = "?"
    return f"{ip} ({host})"


def require_on_node(paths: Mapping[str, str | os.PathLike[str]]) -> None:
    """Check, inside an actor at start, that each named path is absolute and exists on this node.

    A relative path is a driver bug (the driver resolves every input with `absolute_path` first): it would
    name a file under this node's working directory, which is where `ray start` ran, not the driver's. A
    missing absolute path means the node lacks the shared filesystem (or mounts it elsewhere). Either way the
    actor fails before loading anything, and the message names the node.
    """
    for what, value in paths.items():
        path = os.fspath(value)
        if not os.path.isabs(path):
            raise ValueError(
                f"{what} {path!r}: a relative path reached an actor on node {node_name()}, whose working directory "
                f"is {os.getcwd()}, not the driver's; the driver must make it absolute first "
                "(stages.rl.cluster.absolute_path)"
            )
        if not os.path.exists(path):
            raise FileNotFoundError(f"{what} {path}: not found on node {node_name()}; {SHARED_FS_HINT}")
