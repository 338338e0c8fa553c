"""The rl stage on a Ray cluster: the environment actors get, placement that fails in time, absolute paths.

Fast tests check the rules (what passes to actors, the path check's message) and that a placement the
cluster cannot meet fails within its timeout naming what was asked and what is there, on a small local Ray.

The slow tests start a two-node cluster on this machine (tests/ray_cluster.py: a head and a worker node,
each `ray start` run from its own directory) and
- run the rl stage as a new user would: from a third directory, RAY_ADDRESS set, relative --model, --tasks,
  --out and custom reward, two rollout workers pinned one per node by a custom resource; it must end on the
  same weights as the same params on a local Ray (each worker samples from its own seed, derived from the
  step and the worker's index, so the node a worker runs on changes nothing);
- check that actors get the driver's settings but not its secrets, and run where their resources say.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ray_cluster import RayCluster, remove_temp_dirs, start_cluster
from rl_helpers import TOY_REWARD, make_toy_tasks, write_params
from safetensors.torch import load_file

from stages.rl import cluster
from stages.rl.params import RayParams

ROOT = Path(__file__).resolve().parents[1]

# --- the environment actors get ------------------------------------------------------------------------------


def test_passed_environment_passes_settings_and_never_secrets():
    environ = {
        "NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "NCCL_IB_PKEY": "2", "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "CUDA_LAUNCH_BLOCKING": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": "/shared/hf", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "VLLM_ATTENTION_BACKEND": "FLASH_ATTN", "OMP_NUM_THREADS": "4",
        "PYTHONHASHSEED": "0", "LOUPE_TRACKING": "off", "MY_RULES": "/shared/rules", "MYAPP_MODE": "fast",
        # secrets: never, whatever matches them
        "HF_TOKEN": "hf_x", "OPENAI_API_KEY": "sk-x", "MLFLOW_TRACKING_PASSWORD": "pw", "MLFLOW_TRACKING_TOKEN": "t",
        "AWS_SECRET_ACCESS_KEY": "s", "MYAPP_PASSWD": "p", "LOUPE_JUDGE_KEY": "k", "MYAPP_CREDENTIALS": "c",
        # set by Ray per actor, or true of one node only
        "CUDA_VISIBLE_DEVICES": "0,1", "ROCR_VISIBLE_DEVICES": "0", "CUDA_HOME": "/usr/local/cuda",
        "VLLM_HOST_IP": "10.0.0.1",
        # not ours to pass: the shell's and Ray's own
        "PATH": "/usr/bin", "HOME": "/root", "PWD": "/work", "LD_LIBRARY_PATH": "/x", "RAY_ADDRESS": "auto",
        "NCCL_EMPTY": "",
    }
    passed = cluster.passed_environment(["MY_RULES", "MYAPP_*"], environ=environ)
    assert set(passed) == {
        "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "NCCL_IB_PKEY", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING", "HF_HUB_OFFLINE", "HF_HOME", "TRANSFORMERS_OFFLINE",
        "TOKENIZERS_PARALLELISM", "VLLM_ATTENTION_BACKEND", "OMP_NUM_THREADS", "PYTHONHASHSEED", "LOUPE_TRACKING",
        "MY_RULES", "MYAPP_MODE",
    }
    assert passed["NCCL_DEBUG"] == "INFO"
    assert all(not cluster.is_secret(name) for name in passed)


def test_start_ray_hands_the_passed_environment_to_the_job(monkeypatch):
    import ray

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-never")
    monkeypatch.setenv("MY_SETTING", "1")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert cluster.start_ray(RayParams(pass_env=["MY_SETTING"])) is True
    [call] = calls
    assert call["address"] == "10.0.0.1:6379"
    env = call["runtime_env"]["env_vars"]
    assert env["NCCL_DEBUG"] == "WARN" and env["MY_SETTING"] == "1"
    assert "OPENAI_API_KEY" not in env and "RAY_ADDRESS" not in env

    monkeypatch.delenv("RAY_ADDRESS")
    cluster.start_ray(RayParams())
    assert calls[1]["address"] == "local" and calls[1]["include_dashboard"] is False
    assert calls[1]["runtime_env"]["env_vars"]["NCCL_DEBUG"] == "WARN"


# --- paths ---------------------------------------------------------------------------------------------------


def test_require_on_node_names_the_node_and_the_shared_filesystem(tmp_path):
    (tmp_path / "model").mkdir()
    cluster.require_on_node({"model (--model)": tmp_path / "model"})  # there: nothing to say
    with pytest.raises(FileNotFoundError) as found:
        cluster.require_on_node({"model (--model)": str(tmp_path / "model"), "tasks (--tasks)": "/nowhere/tasks"})
    message = str(found.value)
    assert message.startswith("tasks (--tasks) /nowhere/tasks: not found on node ")
    assert f"({os.uname().nodename})" in message
    assert "same shared filesystem at the same mount point" in message
    with pytest.raises(ValueError, match=r"'work/sft/model': a relative path reached an actor on node .*working directory"):
        cluster.require_on_node({"model (--model)": "work/sft/model"})


def test_absolute_paths_are_anchored_at_the_driver_and_keep_symlinks(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.chdir(tmp_path)
    assert cluster.absolute_path("link/model") == tmp_path / "link" / "model"  # not .../real/model
    assert cluster.absolute_path("a/../b") == tmp_path / "b"
    assert cluster.absolute_path(tmp_path / "x") == tmp_path / "x"

    from stages.rl.params import RLParams

    params = RLParams(custom_reward="rewards/mine.py:score",
                      reward={"judge": {"cache_dir": "cache/judge", "api_key_env": None}})
    made = cluster.absolute_params(params)
    assert made.custom_reward == f"{tmp_path}/rewards/mine.py:score"
    assert made.reward.judge.cache_dir == f"{tmp_path}/cache/judge"
    assert cluster.reward_paths(made.custom_reward) == {"rl.custom_reward": f"{tmp_path}/rewards/mine.py"}
    assert cluster.reward_paths(None) == {}
    assert cluster.absolute_params(RLParams()) == RLParams()


# --- placement on a small local Ray --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_ray():
    """A local Ray with one CPU and no GPU (or the one this process already runs)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, num_gpus=0, include_dashboard=False, logging_level="ERROR")
    yield ray
    if started:
        ray.shutdown()


def test_a_learner_placement_the_cluster_cannot_meet_fails_in_time_naming_what_was_asked(small_ray):
    started = time.monotonic()
    with pytest.raises(cluster.PlacementError) as failed:
        cluster.learner_placement(nodes=1, gpus_per_node=2, cpus_per_rank=0.25, timeout_s=3)
    waited = time.monotonic() - started
    assert 3 <= waited < 10, waited
    message = str(failed.value)
    assert "could not place the learner within 3 s" in message
    assert "1 node(s) x 2 bundle(s) {CPU: 0.25, GPU: 1}" in message and "CPU 0.5, GPU 2 in all" in message
    assert "GPU 0/0" in message and "CPU 1/1" in message  # free/total, in all and on the one node
    assert small_ray.util.placement_group_table() == {} or all(  # nothing left reserved
        g["state"] == "REMOVED" for g in small_ray.util.placement_group_table().values())
    assert small_ray.available_resources().get("CPU") == 1


def test_a_worker_placement_without_its_custom_resource_fails_in_time(small_ray):
    with pytest.raises(cluster.PlacementError, match=r"rollout workers within 2 s.*rollout_slot: 1.*rollout_slot 0/0"):
        cluster.worker_placement(2, cpus_per_worker=0.25, gpus_per_worker=0, timeout_s=2,
                                 resources={"rollout_slot": 1})


def test_placed_actors_run_in_their_bundles(small_ray):
    @small_ray.remote
    class Where:
        def cpus(self) -> float:
            return small_ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0)

    placement = cluster.learner_placement(nodes=1, gpus_per_node=2, cpus_per_rank=0.25, timeout_s=30, gpus_per_rank=0)
    try:
        assert placement.actor_options(1)["num_cpus"] == 0.25 and placement.actor_options(1)["num_gpus"] == 0
        actors = [Where.options(**placement.actor_options(i)).remote() for i in range(len(placement))]
        assert small_ray.get([a.cpus.remote() for a in actors], timeout=60) == [0.25, 0.25]
        assert len(set(placement.node_ips())) == 1
        for actor in actors:
            small_ray.kill(actor)
    finally:
        placement.remove()


# --- a two-node cluster on this machine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head and a worker node, each with one `rollout_slot` (so two slot-holding workers land one per node)
    and a resource only it has; started from their own directories; stopped by pid afterwards."""
    ray_cluster = start_cluster(
        tmp_path_factory.mktemp("cluster"),
        head_resources={"loupe_head": 4, "rollout_slot": 1},
        worker_resources={"loupe_worker": 4, "rollout_slot": 1},
    )
    yield ray_cluster
    swept = ray_cluster.stop()
    remove_temp_dirs(ray_cluster)
    assert not swept, f"cluster processes that outlived their node's shutdown: {swept}"


def _driver(ray_cluster: RayCluster, cwd: Path, args: list[str], env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, *args], check=False, cwd=cwd, env={**ray_cluster.driver_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


PROBE = """
import json, os, ray
from stages.rl.cluster import start_ray
from stages.rl.params import RayParams
start_ray(RayParams(pass_env=["LOUPE_PROBE_*"]))

@ray.remote(num_cpus=0.1)
def look(keys):
    return {"cwd": os.getcwd(), "ip_node": ray.get_runtime_context().get_node_id(),
            "env": {k: os.environ.get(k) for k in keys}}

keys = ["NCCL_DEBUG", "LOUPE_PROBE_SETTING", "LOUPE_PROBE_TOKEN", "HF_HUB_OFFLINE"]
where = {name: ray.get(look.options(resources={name: 1}).remote(keys)) for name in ("loupe_head", "loupe_worker")}
print(json.dumps(where))
"""


@pytest.mark.slow
def test_actors_on_both_nodes_get_the_driver_settings_not_its_secrets(two_nodes, tmp_path):
    done = _driver(two_nodes, tmp_path / "driver", ["-c", PROBE],
                   env={"NCCL_DEBUG": "WARN", "LOUPE_PROBE_SETTING": "on", "LOUPE_PROBE_TOKEN": "secret"}, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    import json

    where = json.loads(done.stdout.strip().splitlines()[-1])
    assert where["loupe_head"]["ip_node"] != where["loupe_worker"]["ip_node"]
    # an actor's working directory is its node's (where `ray start` ran), not the driver's
    assert where["loupe_head"]["cwd"] == str(two_nodes.nodes[0].cwd)
    assert where["loupe_worker"]["cwd"] == str(two_nodes.nodes[1].cwd)
    for node in where.values():
        assert node["env"]["NCCL_DEBUG"] == "WARN" and node["env"]["LOUPE_PROBE_SETTING"] == "on"
        assert node["env"]["LOUPE_PROBE_TOKEN"] is None  # the driver had it; the nodes' `ray start` did not


def _stage_inputs(tiny_model_dir: Path, toy_dir: Path, cwd: Path, rl: dict) -> None:
    """The inputs under `cwd` as a user lays them out, named by relative paths from there."""
    (cwd / "work" / "sft").mkdir(parents=True)
    (cwd / "work" / "data").mkdir(parents=True)
    (cwd / "work" / "sft" / "model").symlink_to(tiny_model_dir)
    (cwd / "work" / "data" / "tasks").symlink_to(toy_dir)
    shutil.copy(TOY_REWARD, cwd / "toy_reward.py")
    write_params(cwd / "params.yaml", {**rl, "custom_reward": "toy_reward.py:letter_in_response"})


STAGE = ["-m", "stages.rl", "--params", "params.yaml", "--model", "work/sft/model", "--tasks", "work/data/tasks",
         "--out", "work/rl", "--no-progress"]


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    [file] = list(Path(model_dir).glob("*.safetensors"))
    return load_file(str(file))


@pytest.mark.slow
def test_the_rl_stage_from_another_directory_on_two_nodes_ends_like_a_local_run(two_nodes, tiny_model_dir, tmp_path):
    toy_dir = make_toy_tasks(tmp_path / "toy", count=4)
    rl = {"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 4, "checkpoint_every": 2,
          "ray": {"enabled": True, "num_workers": 2, "cpus_per_worker": 0.5, "placement_timeout_s": 60}}
    on_cluster, local = tmp_path / "user", tmp_path / "local"
    _stage_inputs(tiny_model_dir, toy_dir, on_cluster, {**rl, "ray": {**rl["ray"], "worker_resources": {"rollout_slot": 1}}})
    _stage_inputs(tiny_model_dir, toy_dir, local, rl)

    started = time.monotonic()
    done = _driver(two_nodes, on_cluster, STAGE)
    cluster_seconds = time.monotonic() - started
    assert done.returncode == 0, f"{done.stderr[-6000:]}\n{two_nodes.logs()}"

    local_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    started = time.monotonic()
    reference = subprocess.run([sys.executable, *STAGE], check=False, cwd=local, env=local_env, capture_output=True, text=True,
                               timeout=300)
    local_seconds = time.monotonic() - started
    assert reference.returncode == 0, reference.stderr[-6000:]

    print(f"two-node cluster: started in {two_nodes.start_seconds:.1f} s; rl stage {cluster_seconds:.1f} s on it, "
          f"{local_seconds:.1f} s on a local Ray")
    # a rollout worker ran on the worker node (its Ray logs name the actor class)
    logs = list(two_nodes.nodes[1].temp_dir.glob("session_*/logs/worker-*.out"))
    assert any("RolloutWorker" in log.read_text(errors="replace") for log in logs), [str(p) for p in logs]
    ours, theirs = _weights(on_cluster / "work" / "rl" / "model"), _weights(local / "work" / "rl" / "model")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    start = _weights(tiny_model_dir)
    assert any(not torch.equal(start[k], ours[k]) for k in start)  # two steps changed something
