"""One process per device: its rank and device under ``torchrun`` (or alone), and the model
compiled per block and wrapped for DDP or sharded with FSDP2 (``fully_shard`` per block and at
the root)."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist


@dataclasses.dataclass
class Runtime:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_runtime(device: str) -> Runtime:
    """This process's rank and device (``"cuda"``: the GPU of its local rank), joining the process
    group under torchrun (NCCL on GPU, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = device == "cuda"
    if use_cuda:
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(local)
    else:
        local = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", device_id=local if use_cuda else None)
    return Runtime(rank, world_size, local)


def parallelize(
    model: torch.nn.Module, runtime: Runtime, *, compile_blocks: bool, parallel: str, fullgraph: bool = True
) -> torch.nn.Module:
    """Compile each block (before sharding, as FSDP2 needs; ``fullgraph=False`` where a block may break
    the graph, as the peer libraries' Triton wrappers may), then wrap for DDP or shard with FSDP2."""
    if compile_blocks:
        for block in model.blocks:
            block.compile(fullgraph=fullgraph)
    if runtime.world_size == 1:
        return model
    if parallel == "ddp":
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def gradient_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # an FSDP2 module
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()
