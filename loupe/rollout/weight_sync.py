"""Weights from the learner to the rollout engines: bucketed broadcasts over a process group of their own.

After each update the learner's rank 0 broadcasts the policy's tensors, cast to the engines' dtype, packed in
byte buckets of at most `bucket_bytes`, over a torch.distributed group that joins it and every rollout
engine (rank 0 the learner, ranks 1.. the engines; NCCL on GPU, gloo on CPU). Nothing crosses the driver or
Ray's object store per step: the driver only starts the two sides' calls, and the tensors travel learner ->
engine directly. The same code runs on a laptop (gloo, the transformers engine) and on a cluster (NCCL, vLLM).

- The group is made from a `TCPStore` and a `ProcessGroupGloo`/`ProcessGroupNCCL` object, not with
  `init_process_group`, so it lives beside the learner's own FSDP group (the default group) and vLLM's
  tensor-parallel groups without touching either. That is the idea of vLLM's `StatelessProcessGroup` in
  `vllm/distributed/utils.py` (used by `examples/offline_inference/rlhf_utils.py`,
  `stateless_init_process_group`) and of OpenRLHF's `init_process_group` in
  `openrlhf/utils/distributed_util.py`; torch's own classes keep it independent of vLLM, so the
  transformers engine (no vLLM installed) joins the same way.
- The payload layout, the `manifest`, is plain lists (`[[name, dtype, shape], ...]` per bucket): vLLM's V1
  engine runs its workers in other processes and sends `collective_rpc` arguments through its msgpack encoder,
  which takes no closures and no tensors (`vllm/v1/serial_utils.py`). Both sides derive the byte offsets from
  the manifest with the one function `bucket_layout`.
- vLLM receives through `VLLMWeightSyncExtension`, passed to `vllm.LLM` as `worker_extension_cls` (vLLM mixes
  it into its worker class; `collective_rpc` calls its methods by name), and hands the tensors to the model
  runner's `reload_weights`, which runs the model's own `load_weights` (Hugging Face names to vLLM's fused
  layers, as verl's and OpenRLHF's vLLM workers do: `openrlhf/trainer/ray/vllm_worker_wrap.py`,
  `WorkerWrap.update_weight`) inside vLLM's layerwise reload, so weights vLLM repacked at load time (every
  linear layer on CPU) are repacked again.

A bucket is one broadcast: fewer, larger messages are what make NCCL fast, and a bucket bounds the extra memory
either side holds (the learner's cast copies, the engine's receive buffer) to `bucket_bytes`.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import pickle
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from loupe.models.family import published_layout

ALIGNMENT = 16
"""Byte alignment of each tensor inside a bucket, so a uint8 slice can be viewed as any dtype."""

DEFAULT_BUCKET_BYTES = 256 << 20
"""Largest bucket: one broadcast and the receive buffer's size."""

Manifest = list[list[list[Any]]]
"""Buckets, each a list of `[name, dtype name, shape]` in broadcast order (msgpack-safe plain lists)."""


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: how a dtype travels in a manifest."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in the manifest")
    return dtype


def _nbytes(dtype: str, shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count * dtype_from_name(dtype).itemsize


def _aligned(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def bucket_layout(bucket: list[list[Any]]) -> tuple[list[int], int]:
    """Byte offset of each entry of a bucket, and the bucket's size: the one layout both sides use."""
    offsets, offset = [], 0
    for _, dtype, shape in bucket:
        offset = _aligned(offset)
        offsets.append(offset)
        offset += _nbytes(dtype, shape)
    return offsets, _aligned(offset)


def plan_manifest(
    specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], sync_dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Manifest:
    """Buckets for tensors given as (name, dtype, shape), in order; floating tensors travel as `sync_dtype`.

    A tensor larger than `bucket_bytes` gets a bucket of its own.
    """
    buckets: Manifest = [[]]
    used = 0
    for name, dtype, shape in specs:
        wire = sync_dtype if dtype.is_floating_point else dtype
        entry = [str(name), dtype_name(wire), [int(s) for s in shape]]
        size = _aligned(_nbytes(entry[1], entry[2]))
        if buckets[-1] and used + size > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(entry)
        used += size
    return [b for b in buckets if b]


def manifest_names(manifest: Manifest) -> list[str]:
    return [entry[0] for bucket in manifest for entry in bucket]


def node_address() -> str:
    """This node's address as Ray sees it, else loopback."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except (ImportError, RuntimeError, OSError):
        return "127.0.0.1"


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port: a rendezvous for a group whose rank 0 runs here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return node_address(), port


def device_identity(device: torch.device | str) -> str:
    """`<node address>/<device>`: `cpu`, or the CUDA device's UUID, which names one GPU whatever index a
    process's CUDA_VISIBLE_DEVICES gives it (Ray shows each actor only its own GPUs, renumbered from 0)."""
    device = torch.device(device)
    node = node_address()
    if device.type != "cuda":
        return f"{node}/{device.type}"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{node}/{torch.cuda.get_device_properties(index).uuid}"


def choose_backend(learner: str, engines: list[str]) -> str:
    """The weight-sync transport for a learner and its engines' workers, given each side's `device_identity`.

    - `gloo` when any side is on the CPU, or when some GPU holds two ranks but not every rank: NCCL refuses
      two ranks on one GPU ("Duplicate GPU detected"), which happens when a one-rank learner in the driver on
      cuda:0 and the first rollout worker, given GPU 0 by Ray, sync; or with `rl.ray.enabled: false`;
    - `ipc` when the learner and every engine share one GPU (colocated): the learner hands CUDA IPC handles of
      its buckets and the engines copy from them in place, no host round trip (what verl's and OpenRLHF's
      colocated engines do: OpenRLHF `vllm_worker_wrap.py`, `update_weight_cuda_ipc`);
    - `nccl` when every rank has a GPU of its own.
    """
    everyone = [learner, *engines]
    if any(identity.endswith("/cpu") for identity in everyone):
        return "gloo"
    if len(set(everyone)) == 1:
        return "ipc"
    if len(set(everyone)) < len(everyone):
        return "gloo"
    return "nccl"


class WeightSyncError(RuntimeError):
    """A weight sync that could not finish: the message names the transport, every rank and what each was doing."""


_GRACE_S = 5.0
"""How much longer than `rl.sync_timeout_s` the backend's own timeout is: Loupe's wait gives up first, with a
message that says more than gloo's or NCCL's, and NCCL's watchdog never kills the process before it."""

_LOOK_EVERY_S = 0.2
"""How often a waiting rank reads its peers' notes in the store (a failed peer ends the wait at once)."""

_BROKEN: list[Any] = []
"""Groups left with an operation that will never finish. A ProcessGroupGloo's destructor joins its threads, which
wait out the backend's timeout; keeping the object alive lets the error reach the user now."""


class SyncGroup:
    """This process's membership of the weight-sync group: rank 0 sends, every other rank receives.

    `backend`: `gloo` (buckets through host memory), `nccl` (GPU to GPU) or `ipc` (one GPU shared by every
    rank: buckets stay in the learner's memory and travel as CUDA IPC handles; gloo carries the handles and a
    barrier per bucket). `choose_backend` picks it.

    No wait is unbounded: every rank writes what it is doing into the rendezvous store (`note`), a rank whose
    receive or send raises writes its error there (`reporting`), and each wait (`_wait`) polls its operation
    until it completes, a peer reports a failure, or `timeout_s` passes; the last two raise `WeightSyncError`
    with every rank's note. torch's `Work.wait` would block in C++ with no way to look at the peers.
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 600.0,
        device: torch.device | str = "cpu",
    ):
        if backend not in ("gloo", "nccl", "ipc"):
            raise ValueError(f"weight sync: backend {backend!r}; use gloo (CPU), nccl (a GPU a rank) or ipc (one shared GPU)")
        self.rank, self.world_size, self.backend, self.timeout_s = rank, world_size, backend, float(timeout_s)
        self.device = torch.device(device)
        self.group: Any = None
        self._store: Any = None
        timeout = datetime.timedelta(seconds=self.timeout_s + _GRACE_S)
        try:
            # The learner (rank 0) serves the rendezvous store; it never waits for the others here, the process
            # group's own connection step does.
            store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                                               wait_for_workers=False)
        except Exception as err:  # noqa: BLE001 - the store is unreachable: nothing to read notes from
            raise WeightSyncError(f"weight sync over {backend}: {self._role(rank)} could not reach the group's store at "
                                  f"{host}:{port} within {self.timeout_s:g} s (rl.sync_timeout_s): {err}") from err
        self._store = torch.distributed.PrefixStore("loupe-weight-sync", store)  # must outlive the group
        self.note("joining the group")
        try:
            if backend == "nccl":
                # The group's own timeout: without it a rank that never joins a broadcast hangs the others for
                # NCCL's default of 10 minutes, whatever rl.sync_timeout_s says.
                options = torch.distributed.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.group = torch.distributed.ProcessGroupNCCL(self._store, rank, world_size, options)
            else:
                self.group = torch.distributed.ProcessGroupGloo(self._store, rank, world_size, timeout)
        except Exception as err:  # noqa: BLE001 - said with every rank's note
            raise WeightSyncError(self.story(f"could not form the group at {host}:{port}: {err}")) from err
        self.note("joined, idle")

    # --- what each rank is doing --------------------------------------------------------------------------

    @staticmethod
    def _role(rank: int) -> str:
        return "rank 0 (the learner)" if rank == 0 else f"rank {rank} (an engine)"

    def note(self, doing: str) -> None:
        """Tell the other ranks what this one is doing (read back in their error messages)."""
        self._store.set(f"doing/{self.rank}", doing)

    def report_failure(self, err: BaseException) -> None:
        """Tell the other ranks this one failed, so their waits end now rather than at the timeout."""
        try:
            self._store.set(f"failed/{self.rank}", f"{type(err).__name__}: {err}"[:500])
        except Exception:  # noqa: BLE001 - the store itself is gone (rank 0 died): the others will time out
            pass

    @contextlib.contextmanager
    def reporting(self) -> Iterator[None]:
        """Run a send or receive; an error inside is reported to the other ranks, then raised."""
        try:
            yield
        except BaseException as err:
            self.report_failure(err)
            raise

    def _read(self, key: str) -> str | None:
        try:
            return self._store.get(key).decode() if self._store.check([key]) else None
        except Exception:  # noqa: BLE001 - a store that went away with its rank
            return "(the store did not answer)"

    def _failed_peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank and self._read(f"failed/{r}") is not None]

    def story(self, headline: str) -> str:
        """`headline` for this rank, then each other rank's last note (or its failure)."""
        lines = [f"weight sync over {self.backend}: {self._role(self.rank)} {headline}"]
        for r in range(self.world_size):
            if r == self.rank:
                continue
            failed = self._read(f"failed/{r}")
            doing = self._read(f"doing/{r}")
            state = f"failed: {failed}" if failed else (doing or "never reached the group")
            lines.append(f"  {self._role(r)}: {state}")
        return "\n".join(lines)

    def _wait(self, work: Any, what: str) -> None:
        """Wait for `work` (a collective at step `what`) at most `timeout_s`, ending early if a peer failed."""
        self.note(what)
        deadline = time.monotonic() + self.timeout_s
        look = time.monotonic() + _LOOK_EVERY_S
        pause = 1e-4
        while not work.is_completed():
            now = time.monotonic()
            if now >= deadline:
                _BROKEN.append(self.group)
                raise WeightSyncError(self.story(f"gave up after {self.timeout_s:g} s (rl.sync_timeout_s) at: {what}"))
            if now >= look:
                if self._failed_peers():
                    _BROKEN.append(self.group)
                    raise WeightSyncError(self.story(f"stopped waiting at '{what}': another rank failed"))
                look = now + _LOOK_EVERY_S
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        try:
            work.wait()  # raises what the backend saw (a peer that closed its connection, its own timeout)
        except Exception as err:  # noqa: BLE001 - said with every rank's note
            raise WeightSyncError(self.story(f"failed at '{what}': {err}")) from err

    # --- the operations -----------------------------------------------------------------------------------

    def broadcast(self, buffer: torch.Tensor, what: str = "a broadcast") -> None:
        self._wait(self.group.broadcast(buffer, 0), what)

    def barrier(self, what: str = "a barrier") -> None:
        """Every rank has reached this point (an all-reduce of one number over the group's own connections)."""
        self._wait(self.group.allreduce([torch.zeros(1)]), what)

    def share(self, buffer: torch.Tensor, what: str = "a bucket") -> None:
        """`ipc`, rank 0: hand every rank a handle to `buffer`, then wait until each has copied it out."""
        if buffer.is_cuda:
            torch.cuda.current_stream(buffer.device).synchronize()  # the bucket is written before others read it
        payload = torch.frombuffer(bytearray(_ipc_handle(buffer)), dtype=torch.uint8)
        self.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), f"{what}: sending the handle's size")
        self.broadcast(payload, f"{what}: sending the handle")
        self.barrier(f"{what}: waiting for every engine to copy it out")

    def receive_shared(self, what: str = "a bucket") -> torch.Tensor:
        """`ipc`, ranks 1..: a copy, in this process's memory on the same device, of the bucket rank 0 shares."""
        size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size, f"{what}: receiving the handle's size")
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(payload, f"{what}: receiving the handle")
        self.note(f"{what}: opening the handle")
        shared = pickle.loads(payload.numpy().tobytes())
        # A copy, not the shared memory itself: vLLM's layerwise reload may hold a tensor until its layer is
        # complete, and the learner reuses its bucket memory once the barrier says every rank is done.
        bucket = shared.clone()
        if bucket.is_cuda:
            torch.cuda.current_stream(bucket.device).synchronize()
        del shared
        self.barrier(f"{what}: copied, waiting for the others")
        return bucket

    def close(self) -> None:
        # A ProcessGroup object shuts its connections down when it is collected; drop every reference.
        self.group = None
        self._store = None


def _ipc_handle(buffer: torch.Tensor) -> bytes:
    """`buffer` as bytes another process on this machine can open: a CUDA IPC handle for a GPU tensor (what
    `torch.multiprocessing` sends through its queues, `reductions.reduce_tensor`), a shared-memory file name for
    a CPU tensor (the `file_system` strategy: a name that needs no socket between the two processes). The CPU
    form is what the tests run; the GPU form is the colocated sync's."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    if buffer.is_cuda:
        return bytes(ForkingPickler.dumps(buffer))
    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        buffer.share_memory_()
        return bytes(ForkingPickler.dumps(buffer))
    finally:
        tmp.set_sharing_strategy(before)


def _in_manifest_order(
    tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest, check: bool = True
) -> Iterator[tuple[int, list[Any], torch.Tensor]]:
    """(bucket index, manifest entry, whole tensor) for each of `tensors`, checked against the manifest's order and,
    where `check`, its shapes. A sharded tensor (`DTensor`) is gathered here: `full_tensor` is a collective every
    learner rank joins, so ranks that send nothing still walk the tensors (`check` False)."""
    iterator = iter(tensors)
    for index, bucket in enumerate(manifest):
        for entry in bucket:
            name, _, shape = entry
            found, tensor = next(iterator)
            if found != name:
                raise ValueError(f"weight sync: the manifest expects {name!r} next, the learner gave {found!r}")
            if hasattr(tensor, "full_tensor"):  # an FSDP2 shard: gather the whole tensor (all learner ranks)
                tensor = tensor.full_tensor()
            if check and list(tensor.shape) != shape:
                raise ValueError(f"weight sync: {name} has shape {list(tensor.shape)}, the manifest says {shape}")
            yield index, entry, tensor


def send_weights(group: SyncGroup | None, tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> int:
    """Broadcast `tensors` (in manifest order) bucket by bucket from rank 0; returns the bytes sent.

    `group` is None on learner ranks other than 0: they still walk the tensors, because gathering a sharded
    tensor (`DTensor.full_tensor`) is a collective every learner rank joins, but send nothing.
    """
    if group is None:
        for _ in _in_manifest_order(tensors, manifest, check=False):
            pass
        return 0
    sent = 0
    walk = _in_manifest_order(tensors, manifest)
    with group.reporting():
        for index, bucket in enumerate(manifest):
            offsets, size = bucket_layout(bucket)
            what = f"bucket {index + 1} of {len(manifest)}"
            group.note(f"{what}: packing")
            buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
            for offset, (_, entry, tensor) in zip(offsets, walk):  # offsets first: zip stops before taking a tensor
                _, dtype, shape = entry
                target = buffer[offset : offset + _nbytes(dtype, shape)].view(dtype_from_name(dtype)).view(shape)
                target.copy_(tensor.detach())
            if group.backend == "ipc":
                group.share(buffer, what)
            else:
                group.broadcast(buffer, f"{what}: sending")
            sent += size
        group.note("sent every bucket, idle")
    return sent


def receive_weights(group: SyncGroup, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the buckets in order and yield each tensor as a view of its bucket (copy before the next).

    A generator, so a consumer such as vLLM's `load_weights` holds one bucket at a time. The consumer runs it
    inside `group.reporting()`, so a failure of its own (loading a tensor) reaches the sender too.
    """
    for index, bucket in enumerate(manifest):
        offsets, size = bucket_layout(bucket)
        what = f"bucket {index + 1} of {len(manifest)}"
        if group.backend == "ipc":
            buffer = group.receive_shared(what)
            if buffer.numel() != size:
                raise ValueError(f"weight sync: a shared bucket of {buffer.numel()} bytes, the manifest says {size}")
        else:
            buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
            group.broadcast(buffer, f"{what}: receiving")
        group.note(f"{what}: loading")
        for (name, dtype, shape), offset in zip(bucket, offsets):
            yield name, buffer[offset : offset + _nbytes(dtype, shape)].view(dtype_from_name(dtype)).view(shape)
    group.note("received every bucket, idle")


def cast_weights(tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` checked against the manifest and cast to its dtypes, one at a time: the `direct` path, for an
    engine in the learner's own process, which loads them with no transport and no second copy of the model."""
    for _, (name, dtype, _), tensor in _in_manifest_order(tensors, manifest):
        yield name, tensor.detach().to(dtype_from_name(dtype))


def load_into_module(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy named tensors into a Hugging Face module's parameters and buffers by state-dict name; returns the
    count. Every name must exist: a model of another architecture fails here rather than silently."""
    targets = module.state_dict(keep_vars=True)
    count = 0
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"weight sync: the rollout model has no tensor {name!r}")
            target.data.copy_(tensor)
            count += 1
    return count


def module_digest(module: torch.nn.Module) -> str:
    """A hash of a module's weights (tests compare learner and engine with it)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class VLLMWeightSyncExtension:
    """Mixed into each vLLM worker (`LLM(worker_extension_cls="loupe.rollout.weight_sync.VLLMWeightSyncExtension")`).

    vLLM's `collective_rpc(name, args=...)` calls these methods by name in every worker process; the arguments
    are strings, numbers and lists, which its msgpack encoder carries as they are. `self.device` and
    `self.model_runner` are the worker's own (vLLM's `vllm/v1/worker/gpu_worker.py`, `Worker`).
    """

    def init_weight_sync(self, host: str, port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float) -> None:
        """Join the learner's weight-sync group as rank `rank_offset` + this worker's rank in its engine."""
        try:
            from vllm.distributed.parallel_state import get_world_group

            local_rank = get_world_group().rank
        except (ImportError, AssertionError):  # no vLLM world group (a test harness): one worker per engine
            local_rank = 0
        # Over gloo (colocated: NCCL refuses two ranks on one GPU) the buckets arrive in host memory and
        # load_weights copies them to the GPU. vLLM's WorkerBase holds `device = None` until init_device.
        device = (getattr(self, "device", None) or "cpu") if backend == "nccl" else "cpu"
        self.loupe_sync_group = SyncGroup(host, port, rank_offset + local_rank, world_size, backend, timeout_s, device)

    def receive_weights(self, manifest: Manifest) -> int:
        """Receive one broadcast of the policy and load it into the model; returns the tensors loaded."""
        loaded = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal loaded
            for item in receive_weights(self.loupe_sync_group, manifest):
                loaded += 1
                yield item

        runner = self.model_runner  # type: ignore[attr-defined]
        model_type = getattr(getattr(getattr(runner, "model_config", None), "hf_config", None), "model_type", "")
        # The learner sends the module's tensors; vLLM's loader reads the published checkpoints' layout.
        published = ((name, published_layout(model_type, name, tensor)) for name, tensor in counted())
        with self.loupe_sync_group.reporting():
            self._loupe_load(runner, published)
            self._loupe_repack_cpu_experts(runner)
        return loaded

    @staticmethod
    def _loupe_repack_cpu_experts(runner: Any) -> int:
        """Pack a reloaded MoE layer's experts again for vLLM's CPU kernel; returns the layers packed.

        vLLM 0.32 packs each fused-MoE layer's weights into its CPU grouped-GEMM layout once, after the first load
        (`experts/cpu_moe.py`, `CPUUnquantizedExperts.process_weights_after_loading`); on a reload its
        `UnquantizedFusedMoEMethod.process_weights_after_loading` copies the new weights into that storage and
        skips the packing ("Setup moe kernel only on the first call"), so the kernel reads unpacked weights as
        packed: reloading a Qwen3-VL-MoE's own checkpoint moved its log-probs by up to 0.044 nats. Packing them
        again gives back the first load's numbers exactly (tests/test_vllm_real.py). GPU kernels read the
        weights as stored and are left alone."""
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:
            return 0
        packed = 0
        for module in runner.model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)
                packed += 1
        return packed

    @staticmethod
    def _loupe_load(runner: Any, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        if hasattr(runner, "reload_weights"):
            # vLLM's in-place reload (`GPUModelRunner.reload_weights`, which the CPU runner inherits;
            # `model_executor/model_loader/reload/inplace.py`): it runs the model's own `load_weights` between
            # `initialize_layerwise_reload` and `finalize_layerwise_reload`, so layers whose weights vLLM
            # post-processed at load time get them processed again. On CPU that is every linear layer: vLLM packs
            # it into a oneDNN handle and empties `layer.weight`, and a bare `load_weights` then asserts. It also
            # drops this worker's encoder and multimodal caches; the scheduler's side is the engine's to reset.
            runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        else:  # a harness whose model runner is only a holder of the model
            runner.model.load_weights(weights=weights)

    def weights_digest(self) -> str:
        return module_digest(self.model_runner.model)  # type: ignore[attr-defined]

    def device_identity(self) -> str:
        return device_identity(getattr(self, "device", None) or "cpu")
