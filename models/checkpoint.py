"""Checkpoints of ``python -m models.train``: one safetensors file with the model, the optimizer
state, the RNG states of every rank and, in its metadata, the step, the model's config, the
optimizer's param groups, what the batches depend on (seed, text hash) and the loss history.

Tensors are gathered to full (unsharded) tensors on CPU, so a checkpoint written by one DDP or FSDP2
layout loads into another, and into a single process. A tied weight is stored once, under its
source. Resuming on the same device and number of ranks restores every rank's RNG state, which
makes the resumed losses bit-for-bit those of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from models.parallel import Runtime, unwrap
from models.presets import MODELS

CHECKPOINT_FORMAT = "tk_ops-models-checkpoint-1"


def _rng_states(runtime: Runtime) -> dict[str, torch.Tensor]:
    """The RNG states of every rank (gathered on all ranks), keyed ``rng.<device>.<rank>``."""
    local = {"cpu": torch.get_rng_state()}
    if runtime.device.type == "cuda":
        local["cuda"] = torch.cuda.get_rng_state(runtime.device)
    gathered = [local]
    if runtime.world_size > 1:
        gathered = [None] * runtime.world_size
        dist.all_gather_object(gathered, local)
    return {f"rng.{kind}.{rank}": state for rank, states in enumerate(gathered) for kind, state in states.items()}


def _model_state(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict of ``model`` in a checkpoint's tensors, with each tied weight put back."""
    state = {key.removeprefix("model."): value for key, value in tensors.items() if key.startswith("model.")}
    for key, source in unwrap(model).tied_weights.items():
        state[key] = state[source]
    return state


def save_checkpoint(
    path: Path, model, optimizer, runtime: Runtime, *, step: int, history: dict, kind: str, seed: int, text_sha256: str
) -> None:
    """Write the training state after ``step`` (collective: every rank calls it, rank 0 writes);
    ``kind`` is the --model name, ``seed`` and ``text_sha256`` what the batches depend on."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)
    rng = _rng_states(runtime)
    if runtime.is_main:
        tied = unwrap(model).tied_weights
        tensors = {f"model.{k}": v.contiguous() for k, v in model_state.items() if k not in tied}
        for name, state in optimizer_state["state"].items():
            tensors.update({f"optimizer.{name}.{k}": v.contiguous() for k, v in state.items()})
        tensors.update(rng)
        metadata = {
            "format": CHECKPOINT_FORMAT,
            "step": str(step),
            "world_size": str(runtime.world_size),
            "model": kind,
            "config": unwrap(model).config.to_json(),
            "param_groups": json.dumps(optimizer_state["param_groups"]),
            "data": json.dumps({"position": step, "seed": seed, "text_sha256": text_sha256}),
            "history": json.dumps(history),
        }
        temporary = path.with_suffix(".tmp")
        save_file(tensors, str(temporary), metadata=metadata)
        os.replace(temporary, path)  # a crash while writing leaves the previous checkpoint intact
    if runtime.world_size > 1:
        dist.barrier()


def load_checkpoint(path: Path, model, optimizer, runtime: Runtime, *, seed: int, text_sha256: str) -> tuple[int, dict]:
    """Restore model, optimizer and RNG states from ``path``; return (step, history). Refuses a
    checkpoint of another model config, seed or text."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    if not path.exists():
        raise SystemExit(f"--resume: no checkpoint at {path}")
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"{path} is not a checkpoint of this script (format {metadata.get('format')!r})")
    config = unwrap(model).config
    if json.loads(metadata["config"]) != json.loads(config.to_json()):
        raise SystemExit(f"{path} holds another model config: {metadata['config']}")
    data = json.loads(metadata["data"])
    if (data["seed"], data["text_sha256"]) != (seed, text_sha256):
        raise SystemExit(f"{path} was trained on other data or with another --seed: {data}")
    tensors = load_file(str(path))
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, _model_state(tensors, model), options=options)
    optimizer_state: dict = {"state": {}, "param_groups": json.loads(metadata["param_groups"])}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            name, state_key = key.removeprefix("optimizer.").rsplit(".", 1)
            optimizer_state["state"].setdefault(name, {})[state_key] = value
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
    if f"rng.cpu.{runtime.rank}" in tensors and int(metadata["world_size"]) == runtime.world_size:
        torch.set_rng_state(tensors[f"rng.cpu.{runtime.rank}"])
        if runtime.device.type == "cuda" and f"rng.cuda.{runtime.rank}" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{runtime.rank}"], runtime.device)
    return int(metadata["step"]), json.loads(metadata["history"])


def load_model(path: Path, *, reference: bool = False, peer: bool = False) -> torch.nn.Module:
    """The model of a checkpoint, on CPU in eval mode (e.g. to sample from it), on the path asked for
    (whatever path trained it)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        tensors = {key: f.get_tensor(key) for key in f.keys() if key.startswith("model.")}
    fields = {**json.loads(metadata["config"]), "reference": reference or peer}
    if peer or "peer" in fields:  # a config of Based, Mamba-2 or Hyena (those of earlier checkpoints have none)
        fields["peer"] = peer
    config_class, model_class = MODELS[metadata["model"]]
    model = model_class(config_class(**fields))
    model.load_state_dict(_model_state(tensors, model))
    return model.eval()
