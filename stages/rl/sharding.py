"""FSDP2 sharding of a policy (or the critic's body) across the learner's ranks: its own module, so the learner and
the critic both use it without importing each other."""

from __future__ import annotations

from typing import Any


def shard_model(model: Any, mesh: Any = None, mp_policy: Any = None, root: Any = None) -> Any:
    """Shard `model` in place with FSDP2: each decoder layer and vision block, then the root module.

    `mp_policy` (`precision.fsdp_mixed_precision`) goes to every `fully_shard`: a module's own policy decides
    the dtype its weights are gathered in and its gradients reduced in, so one left out would run in float32.
    On a GPU mesh `fully_shard` moves each rank's shard onto the GPU; the model may be loaded on the CPU.
    `root`: the module whose forward is called, when it wraps `model` (the critic's ValueModel, which calls the
    body's inner model directly, so the body's own root hook would never run); it becomes the root instead.
    """
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    inner = model.model
    for layer in inner.language_model.layers:
        fully_shard(layer, **options)
    for block in getattr(inner.visual, "blocks", []):
        fully_shard(block, **options)
    fully_shard(root if root is not None else model, **options)
    return model
