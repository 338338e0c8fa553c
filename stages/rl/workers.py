"""The rl stage's actors: rollout workers, the reward pool, and the sharded learner group, on Ray or in-process.

- `RolloutWorker` owns one rollout engine (`loupe.rollout.make_engine`: transformers on CPU, vLLM on GPU) and
  runs the shared multi-turn loop (`loupe.rollout.run_rollouts`) on its share of a step's prompts. Before each
  rollout it reseeds its engine from (seed, step, try, worker), so rollouts are a function of the weights and
  the seed. After each update its engine receives the learner's weights by broadcast over the weight-sync group
  (`loupe.rollout.weight_sync`): `WorkerSet.sync_weights` starts the receivers and the learner's send together;
  no tensor passes through the driver or the object store.
- `RewardPool` scores finished trajectories with `loupe.rewards.score_trajectory` (or a custom function):
  rules inline, LLM-judge calls on a thread pool so they overlap, answers cached by the judge.
- `LearnerGroup` runs one `Learner` per GPU under a torch.distributed process group (NCCL on GPU, gloo on
  CPU) with the policy sharded by FSDP2; it hands each rank a share of the batch and returns rank 0's answer.
  A step's images go into Ray's object store once and reach the ranks by reference; each rank computes their
  pixel values itself.

`WorkerSet` and `RewardService` give the trainer one interface whether the actors are Ray actors or plain
objects in this process (`rl.ray.enabled: false`, used by the fast tests), so both paths run the same code.
Ray: `RAY_ADDRESS` (or the variable `rl.ray.address_env` names) joins an existing cluster; otherwise a local
Ray starts with this machine's CPUs and no dashboard.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from loupe.config import ProtocolParams, RolloutParams
from loupe.data.tasks import TaskRecord
from loupe.remote_reward import RemoteRewardConfig, RemoteRewardModel, remote_item
from loupe.rewards import (
    RewardConfig,
    build_judge,
    load_custom_reward,
    score_trajectory,
)
from loupe.rollout import Engine, RolloutStats, make_engine, run_rollouts
from loupe.rollout.weight_sync import free_address
from loupe.trajectory import Trajectory
from stages.rl.batching import TrainSequence, split_evenly
from stages.rl.cluster import (
    learner_placement,
    require_on_node,
    reward_paths,
    start_ray,  # noqa: F401 - moved to stages.rl.cluster, importable from here
    worker_placement,
)
from stages.rl.params import RLParams


class RolloutWorker:
    """One rollout engine and the shared rollout loop."""

    def __init__(
        self,
        model_path: str,
        rollout: RolloutParams,
        protocol: ProtocolParams,
        image_root: str,
        seed: int = 0,
        index: int = 0,
        model: Any = None,
        sleep_mode: bool = False,
        compute_dtype: Any = None,
    ):
        require_on_node({"model (--model)": model_path, "tasks (--tasks)": image_root})
        self.protocol = protocol
        self.image_root = image_root
        self.index = index
        # `model`: the learner's own module (colocated mode); the engine then generates with the live policy.
        self.engine = make_engine(rollout, protocol, model_path=model_path, seed=seed, model=model, sleep_mode=sleep_mode,
                                  compute_dtype=compute_dtype)
        if type(self.engine).trace is Engine.trace:  # the base class's: this engine keeps no token ids
            raise ValueError(f"rl: the {rollout.engine} engine keeps no token trace; use transformers or vllm")

    def rollout(
        self, tasks: list[TaskRecord], samples: int, seed: int, max_turns: int, max_new_tokens: int,
        temperature: float | None = None,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """`samples` trajectories per task, sampled from a generator seeded with `seed`, at `temperature` for
        this call (validation's) or the engine's own."""
        if temperature is not None and temperature != self.engine.temperature:
            trained, self.engine.temperature = self.engine.temperature, temperature
            try:
                return self.rollout(tasks, samples, seed, max_turns, max_new_tokens)
            finally:
                self.engine.temperature = trained
        # Engines sample from their own generators (the transformers engine) or per-request seeds derived from
        # theirs (vLLM): reseeding them makes a step's rollouts depend on (weights, seed) alone. Torch's global
        # generator is left alone: an overlapped rollout runs beside the learner, which draws from it.
        self.engine.reseed(seed)
        stats = RolloutStats()
        if not tasks:
            return [], stats
        trajectories = run_rollouts(
            tasks, self.engine, self.protocol, self.image_root, samples, max_turns, max_new_tokens, stats=stats
        )
        return trajectories, stats

    # Weights arrive by broadcast from the learner (loupe.rollout.weight_sync): the driver only starts the calls.

    def init_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        self.engine.init_weight_sync(host, port, rank, world_size, backend, timeout_s)

    def receive_weights(self, manifest: list) -> int:
        return self.engine.receive_weights(manifest)

    def load_weights(self, weights: Any) -> int:
        return self.engine.load_weights(weights)

    def weights_changed(self) -> None:
        self.engine.weights_changed()

    def weights_format(self) -> tuple[str, str]:
        return self.engine.weights_format()

    def device_identity(self) -> list[str]:
        return self.engine.device_identity()

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.engine.wake_up(tags)

    def weights_digest(self) -> str:
        return self.engine.weights_digest()

    def close(self) -> None:
        self.engine.close()


def _strip(trajectory: Trajectory) -> Trajectory:
    """A copy without the token trace and crops: what the reward pool needs, cheap to send."""
    return dataclasses.replace(trajectory, trace=None, pending={})


class RewardPool:
    """Scores trajectories: rules inline, LLM-judge calls concurrently (and cached by the judge)."""

    def __init__(self, cfg: RewardConfig, custom_reward: str | None = None, concurrency: int = 8,
                 remote: RemoteRewardConfig | None = None):
        require_on_node(reward_paths(custom_reward))
        self.cfg = cfg
        self.judge = build_judge(cfg)
        self.remote = RemoteRewardModel(remote) if remote is not None else None
        self.concurrency = concurrency
        self.custom = load_custom_reward(custom_reward) if custom_reward else None
        wrapped = getattr(self.custom, "__wrapped__", None)
        self.custom_takes_trajectory = False
        if wrapped is not None and not getattr(self.custom, "verl_style", False):
            parameters = inspect.signature(wrapped).parameters
            self.custom_takes_trajectory = "trajectory" in parameters or any(
                p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
            )

    def _score_one(self, trajectory: Trajectory) -> dict[str, Any]:
        if self.custom is None:
            return score_trajectory(trajectory, self.cfg, self.judge).to_dict()
        assistant = [turn.text for turn in trajectory.turns if turn.role == "assistant"]
        kwargs: dict[str, Any] = {
            "task": TaskRecord.model_validate(trajectory.task),
            "answer": trajectory.answer,
            "end_reason": trajectory.end_reason or "format_error",
            "num_tool_calls": trajectory.num_tool_calls,
            "num_format_errors": trajectory.num_format_errors,
            "has_think": bool(assistant) and all("<think>" in t and "</think>" in t for t in assistant),
            "cfg": self.cfg,
            "judge": self.judge,
        }
        if self.custom_takes_trajectory:
            kwargs["trajectory"] = trajectory
        if getattr(self.custom, "verl_style", False):
            kwargs["response"] = "\n".join(assistant)
        return self.custom(**kwargs).to_dict()

    def score(self, trajectories: list[Trajectory]) -> list[dict[str, Any]]:
        """Reward parts of each trajectory, in order."""
        if self.judge is None or len(trajectories) <= 1:
            parts = [self._score_one(t) for t in trajectories]
        else:
            with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="reward") as pool:
                parts = list(pool.map(self._score_one, trajectories))
        if self.remote is not None:
            parts = self._remote_totals(trajectories, parts)
        return parts

    def _remote_totals(self, trajectories: list[Trajectory], parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The remote reward model's reward as each total; a failed one makes the reward invalid."""
        scores = self.remote.score_many([remote_item(t) for t in trajectories])  # type: ignore[union-attr]
        out = []
        for rule, remote in zip(parts, scores):
            if remote.valid:
                out.append({**rule, "total": remote.reward, "rule_total": rule["total"]})
            else:
                out.append({**rule, "total": None, "valid": False, "rule_total": rule["total"],
                            "invalid_reason": f"remote reward failed: {remote.error}"})
        return out


# --- one interface over Ray actors and local objects -------------------------------------------------------


class WorkerSet:
    """The rollout workers: splits a step's prompts among them and gathers the trajectories in order."""

    def __init__(
        self,
        model_path: str,
        rollout: RolloutParams,
        protocol: ProtocolParams,
        image_root: str,
        params: RLParams,
        seed: int,
        use_ray: bool,
        colocated_model: Any = None,
        colocated_dtype: Any = None,
    ):
        """`colocated_model`: the learner's module; one in-process worker generates with it (no weight sync), under
        autocast to `colocated_dtype` (the learner's compute dtype; None on CPU)."""
        self.colocated = colocated_model is not None
        self.use_ray = use_ray and not self.colocated
        args = (model_path, rollout, protocol, str(image_root), seed)
        # vLLM colocated on the learner's GPU(s): a Ray actor with a fraction of the GPU, asleep during updates.
        self.sleeps = params.ray.colocate and rollout.engine == "vllm"
        if self.colocated:
            self.workers = [RolloutWorker(*args, index=0, model=colocated_model, compute_dtype=colocated_dtype)]
        elif use_ray:
            import ray

            r = params.ray
            self.placement = worker_placement(r.num_workers, r.cpus_per_worker, r.gpus_per_worker,
                                              r.placement_timeout_s, r.worker_resources)
            actor = ray.remote(RolloutWorker)
            self.workers = [actor.options(**self.placement.actor_options(i)).remote(*args, index=i, sleep_mode=self.sleeps)
                            for i in range(r.num_workers)]
        else:
            self.workers = [RolloutWorker(*args, index=i, sleep_mode=self.sleeps) for i in range(params.ray.num_workers)]
        self.direct = not self.colocated and not self.use_ray and all(w.engine.receives_in_process for w in self.workers)
        """The engines' models live in this process, the learner's (Ray off, the transformers engine): weights are
        handed over directly, with no transport. Issue 41: on one GPU the transport rule picked `ipc` here, and
        a CUDA IPC handle cannot be opened by the process that made it, so the sync waited for ever."""

    def _call(self, calls: list[tuple[Any, str, tuple]]) -> list[Any]:
        return self._finish(self._start(calls))

    def _start(self, calls: list[tuple[Any, str, tuple]], background: bool = False) -> list[Any]:
        """Start the calls without waiting (Ray futures, or threads in-process): the weight sync needs the
        workers receiving while the learner sends, and an overlapped rollout (`background`) runs while it updates."""
        if self.use_ray:
            return [getattr(worker, method).remote(*args) for worker, method, args in calls]
        if len(calls) == 1 and calls[0][1] not in _CONCURRENT and not background:
            worker, method, args = calls[0]
            return [_Done(getattr(worker, method)(*args))]
        pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="rollout-worker")
        futures = [pool.submit(getattr(worker, method), *args) for worker, method, args in calls]
        pool.shutdown(wait=False)
        return futures

    def _finish(self, pending: list[Any]) -> list[Any]:
        if self.use_ray:
            import ray

            return ray.get(pending)
        return [p.result() for p in pending]

    def rollout(
        self, tasks: list[TaskRecord], samples: int, seeds: list[int], max_turns: int, max_new_tokens: int,
        temperature: float | None = None,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """Every task's `samples` trajectories, task order kept; worker i samples with `seeds[i]`."""
        return self.finish_rollout(self.start_rollout(tasks, samples, seeds, max_turns, max_new_tokens, temperature))

    def start_rollout(
        self, tasks: list[TaskRecord], samples: int, seeds: list[int], max_turns: int, max_new_tokens: int,
        temperature: float | None = None, background: bool = False,
    ) -> list[Any]:
        """`rollout` started and not waited for; `finish_rollout` collects it. `background`: in-process workers
        run it in a thread even alone (an overlapped rollout)."""
        shares = split_evenly(tasks, len(self.workers))
        return self._start(
            [(w, "rollout", (share, samples, seeds[i], max_turns, max_new_tokens, temperature))
             for i, (w, share) in enumerate(zip(self.workers, shares))],
            background,
        )

    def finish_rollout(self, pending: list[Any]) -> tuple[list[Trajectory], RolloutStats]:
        results = self._finish(pending)
        trajectories: list[Trajectory] = []
        total = RolloutStats()
        for found, stats in results:
            trajectories += found
            for field in dataclasses.fields(RolloutStats):
                setattr(total, field.name, getattr(total, field.name) + getattr(stats, field.name))
        return trajectories, total

    def weights_format(self) -> tuple[str, str]:
        """(dtype, device type) of the rollout engines' weights (worker 0's; every worker runs the same engine)."""
        return tuple(self._call([(self.workers[0], "weights_format", ())])[0])  # type: ignore[return-value]

    def device_identities(self) -> list[list[str]]:
        """Each worker's receiving processes' (node, device) keys, in rank order (weight_sync.choose_backend):
        one for a transformers engine, one a GPU for a tensor-parallel vLLM engine."""
        return self._call([(w, "device_identity", ()) for w in self.workers])

    def weights_digests(self) -> list[str]:
        return self._call([(w, "weights_digest", ()) for w in self.workers])

    def sleep(self) -> None:
        """Colocated vLLM: free the GPU for the learner's update (a no-op otherwise)."""
        if self.sleeps:
            self._call([(w, "sleep", ()) for w in self.workers])

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleeps:
            self._call([(w, "wake_up", (tags,)) for w in self.workers])

    def connect_weights(self, learner: Any, identities: list[list[str]], backend: str, timeout_s: float) -> None:
        """Form the weight-sync group: the learner's rank 0 as rank 0, then each worker's receiving processes
        (`identities`, from `device_identities`) in order."""
        if self.colocated or self.direct:  # the learner's own module, or weights handed over in this process
            return
        host, port = learner.sync_address()
        sizes = [len(found) for found in identities]
        world_size = 1 + sum(sizes)
        firsts = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        pending = self._start(
            [(w, "init_weight_sync", (host, port, firsts[i], world_size, backend, timeout_s)) for i, w in enumerate(self.workers)]
        )
        learner.init_weight_sync(host, port, world_size, backend, timeout_s)
        self._finish(pending)

    def sync_weights(self, learner: Any, manifest: list) -> int:
        """The learner's weights to every worker by broadcast; returns the bytes sent."""
        expected = sum(len(bucket) for bucket in manifest)
        if self.colocated:
            for worker in self.workers:
                worker.weights_changed()
            return 0
        if self.direct:
            loaded = [w.load_weights(learner.cast_weights(manifest)) for w in self.workers]
            sent = 0
        else:
            pending = self._start([(w, "receive_weights", (manifest,)) for w in self.workers])
            try:
                sent = learner.send_weights(manifest)
            finally:
                # A receiver's own error says more than the sender's; either way no call is left behind.
                loaded = self._finish(pending)
        if any(count != expected for count in loaded):
            raise RuntimeError(f"weight sync: workers loaded {loaded} tensors, the manifest holds {expected}")
        return sent

    def close(self) -> None:
        if self.use_ray:
            import ray

            for worker in self.workers:
                ray.kill(worker)
            self.placement.remove()
        else:
            for worker in self.workers:
                worker.close()


_CONCURRENT = ("init_weight_sync", "receive_weights")
"""Worker methods that block until the learner joins: run in threads even for a single in-process worker."""


class _Done:
    """An already-finished call, shaped like a future."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


class RewardService:
    """The reward pool, as a Ray actor or in-process; sends trajectories without their traces."""

    def __init__(self, params: RLParams, use_ray: bool):
        # custom reward and judge cache are absolute already: inputs.read_inputs (cluster.absolute_params)
        custom, reward = params.custom_reward, params.reward
        args = (reward, custom, params.ray.reward_concurrency, params.remote_reward)
        self.use_ray = use_ray
        if use_ray:
            import ray

            self.pool = ray.remote(RewardPool).options(num_cpus=0.1).remote(*args)
        else:
            self.pool = RewardPool(*args)

    def score(self, trajectories: list[Trajectory]) -> list[dict[str, Any]]:
        light = [_strip(t) for t in trajectories]
        if self.use_ray:
            import ray

            return ray.get(self.pool.score.remote(light))
        return self.pool.score(light)


# --- the sharded learner -----------------------------------------------------------------------------------


class LearnerRank:
    """One rank of the learner group: joins the process group, then owns a sharded `Learner`."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.learner: Any = None
        self._images: dict[str, Any] = {}
        """A step's images by object-store id: every pass of the step sees the same object (the learner's image
        cache is keyed by object), fetched once per rank."""

    def address(self) -> tuple[str, int]:
        return free_address()

    def setup(self, host: str, port: int, model_path: str, params: RLParams, temperature: float, budget: int) -> None:
        from stages.rl.learner import Learner

        require_on_node({"model (--model)": model_path, **({"rl.critic.path": params.critic.path} if params.critic.path else {})})
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
        cuda = torch.cuda.is_available()
        torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=self.rank, world_size=self.world)
        if cuda:  # Ray shows each rank only its own GPU
            torch.cuda.set_device(0)
        self.learner = Learner(model_path, params, temperature, budget, device="cuda" if cuda else "cpu", distributed=True)

    def call(self, method: str, *args: Any) -> Any:
        for arg in args:
            if isinstance(arg, list):
                for sequence in arg:
                    if isinstance(sequence, TrainSequence):
                        sequence.images = [self._image(ref) for ref in sequence.images]
        result = getattr(self.learner, method)(*args)
        if method == "update":  # the step is over; its images are not needed again
            self._images.clear()
        return result

    def _image(self, ref: Any) -> Any:
        import ray

        if not isinstance(ref, ray.ObjectRef):
            return ref
        key = ref.hex()
        if key not in self._images:
            self._images[key] = ray.get(ref)
        return self._images[key]


class LearnerGroup:
    """`world` learner ranks as Ray actors, used exactly like a single `Learner`."""

    def __init__(self, model_path: str, params: RLParams, temperature: float, budget: int, world: int, gpus: float = 1.0):
        import ray

        self.world = world
        nodes = params.ray.nodes if world % params.ray.nodes == 0 else 1
        self.placement = learner_placement(nodes, world // nodes, 1 if gpus else 0.5, params.ray.placement_timeout_s,
                                           params.ray.learner_resources, gpus_per_rank=gpus)
        actor = ray.remote(LearnerRank)
        self.ranks = [actor.options(**self.placement.actor_options(r)).remote(r, world) for r in range(world)]
        host, port = ray.get(self.ranks[0].address.remote())
        ray.get([rank.setup.remote(host, port, model_path, params, temperature, budget) for rank in self.ranks])
        self._image_refs: dict[int, tuple[Any, Any]] = {}

    def _by_reference(self, sequences: list[TrainSequence]) -> list[TrainSequence]:
        """Copies of `sequences` that carry object-store references instead of images.

        Each distinct image object goes into Ray's object store once per step, on its first call (a group's
        samples share their question image object); later passes of the step (old log-probs, reference, update)
        send only the references, and ranks on one node read the same stored copy.
        """
        import ray

        out = []
        for sequence in sequences:
            refs = []
            for image in sequence.images:
                if id(image) not in self._image_refs:  # the entry holds the image, so its id is not reused
                    self._image_refs[id(image)] = (image, ray.put(image))
                refs.append(self._image_refs[id(image)][1])
            out.append(dataclasses.replace(sequence, images=refs))
        return out

    def _all(self, method: str, *per_rank_args: Any, same: tuple = ()) -> list[Any]:
        import ray

        calls = []
        for r, rank in enumerate(self.ranks):
            args = tuple(a[r] for a in per_rank_args) + same
            calls.append(rank.call.remote(method, *args))
        return ray.get(calls)

    def _shares(self, sequences: list[Any]) -> list[list[Any]]:
        return [sequences[r :: self.world] for r in range(self.world)]

    @staticmethod
    def _filler(sequences: list[Any]) -> list[Any]:
        """A trained sequence every rank can run with zero weight to keep the collectives in step."""
        return next(([s] for s in sequences if s.num_trained), [])

    def _per_sequence(self, method: str, sequences: list[Any], *same: Any) -> list[torch.Tensor]:
        """Each rank computes `method` over its share; the results come back in `sequences`' order."""
        sequences = self._by_reference(sequences)
        shares, filler = self._shares(sequences), self._filler(sequences)
        results = self._all(method, shares, [filler] * self.world, same=same)
        out: list[Any] = [None] * len(sequences)
        for r, found in enumerate(results):
            for i, value in zip(range(r, len(sequences), self.world), found):
                out[i] = value
        return out

    def logprobs(self, sequences: list[Any], reference: bool = False) -> list[torch.Tensor]:
        return self._per_sequence("logprobs", sequences, reference)

    def values(self, sequences: list[Any]) -> list[torch.Tensor]:
        return self._per_sequence("values", sequences)

    def update(self, sequences: list[Any], train_policy: bool = True, lr: float | None = None) -> dict[str, float]:
        sequences = self._by_reference(sequences)
        shares, filler = self._shares(sequences), self._filler(sequences)
        try:
            return self._all("update", shares, [filler] * self.world, same=(train_policy, lr))[0]
        finally:
            self._image_refs.clear()  # the step is over: let the object store free its images

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._all("state_dict")[0]

    def weight_specs(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        return self._all("weight_specs")[0]

    def device_identity(self) -> str:
        return self._all("device_identity")[0]

    def offload_optimizer(self) -> int:
        return self._all("offload_optimizer")[0]

    def sync_address(self) -> tuple[str, int]:
        import ray

        return ray.get(self.ranks[0].address.remote())

    def init_weight_sync(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self._all("init_weight_sync", same=(host, port, world_size, backend, timeout_s))

    def send_weights(self, manifest: list) -> int:
        return self._all("send_weights", same=(manifest,))[0]

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._all("load_state_dict", same=(state,))

    def save_checkpoint(self, folder: Path) -> None:
        self._all("save_checkpoint", same=(folder,))

    def load_checkpoint(self, folder: Path) -> None:
        self._all("load_checkpoint", same=(folder,))

    def save_model(self, final: Path, model_path: str | Path) -> None:
        self._all("save_model", same=(final, model_path))

    def close(self) -> None:
        import ray

        for rank in self.ranks:
            ray.kill(rank)
        self.placement.remove()
