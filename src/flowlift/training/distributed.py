"""The process a training run lives in: its rank in the ``torchrun`` process group and its device.

A single process is a world of one (a default :class:`DistContext`), so the trainer's loop is the
same code either way; :meth:`DistContext.mean` and :meth:`DistContext.barrier` are how ranks agree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def main_outcome(self, problem: str | None) -> str | None:
        """Rank 0's ``problem`` (None: none) on every rank, the ranks meeting as at a barrier: what rank 0 alone did
        (a checkpoint, the validation) fails every rank together, where a rank erring alone left the others in
        their next collective until its timeout."""
        if self.world_size == 1:
            return problem
        box = [problem]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: object) -> list:
        """Every rank's ``value``, by rank, on every rank (the ranks meeting as at a barrier): a verdict computed from
        the list is the same on every rank, so no rank errs alone and leaves the others waiting."""
        if self.world_size == 1:
            return [value]
        values: list = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def mean(self, value: float, device: torch.device) -> float:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
        torch.distributed.all_reduce(tensor)
        return float(tensor.item()) / self.world_size

    def close(self) -> None:
        if self.initialized_here and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if self.world_size > 1:  # the group's threads outlive it once DDP ran (devices.end_before_native_teardown)
            from flowlift.devices import end_before_native_teardown

            end_before_native_teardown()


def init_distributed(device_kind: str) -> DistContext:
    """Join the process group set up by ``torchrun`` (``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` in the
    environment), NCCL on CUDA and gloo on CPU; a plain single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    created = False
    if not torch.distributed.is_initialized():
        from flowlift.jobs.group_start import join_group, joining

        backend = "nccl" if device_kind == "cuda" else "gloo"
        # torch's default timeouts (gloo's 30 minutes, NCCL's shorter); under flowlift launch a start still
        # blocked past the longer one is ended (flowlift.jobs.group_start)
        with joining(torch.distributed.constants.default_pg_timeout.total_seconds()):
            join_group(backend)
        created = True
    return DistContext(rank=rank, world_size=world_size, local_rank=local_rank, initialized_here=created)


def pick_device(setting: str, dist: DistContext) -> torch.device:
    from flowlift.devices import resolve_device
    from flowlift.errors import FIELD_MARK, FlowliftError

    try:
        device = resolve_device(setting)
    except FlowliftError as error:  # said as every command says it: --device cuda: ...
        raise FlowliftError(f"{FIELD_MARK} {setting}: {error}", field="device") from None
    if device.type == "cuda":
        if dist.world_size > 1 or device.index is None:
            device = torch.device("cuda", dist.local_rank if dist.world_size > 1 else (device.index or 0))
        torch.cuda.set_device(device)
    return device
