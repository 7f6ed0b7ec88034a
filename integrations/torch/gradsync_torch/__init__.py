"""gradsync as a torch.distributed backend.

    import gradsync_torch                       # registers backend "gradsync"
    gradsync_torch.init_process_group()         # under gradsyncrun: RANK, WORLD_SIZE, ...
    model = torch.nn.parallel.DistributedDataParallel(model)

The backend's communicator joins through the gradsync daemon and coordinator named by
gradsyncrun's environment; no MASTER_ADDR, no TCP store. torch 1.13 still ends
init_process_group (and new_group) with a barrier over the store it is given: the store of
init_process_group() here (_GradsyncStore) answers that barrier with a gradsync allreduce.
Version differences (1.13's ProcessGroup, 2.x's Backend) are in torch_compat.h and in
register() below.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ._gradsync_torch import ProcessGroupGradsync, TORCH_BASE_CLASS

__all__ = ["ProcessGroupGradsync", "init_process_group", "register", "TORCH_BASE_CLASS"]

_groups = []  # the groups made by this process, newest last (the store's barrier uses it)


def _create(store, rank, world_size, timeout):
    group = ProcessGroupGradsync(rank, world_size, timeout.total_seconds())
    _groups.append(group)
    return group


def register():
    """Registers "gradsync" with torch.distributed (done on import)."""
    if "GRADSYNC" in getattr(dist.Backend, "_plugins", {}):
        return
    if TORCH_BASE_CLASS == "Backend":  # torch 2.x: the creator makes a per-device Backend
        dist.Backend.register_backend("gradsync", _create, devices=["cpu", "cuda"])
    else:  # torch 1.13: the creator makes the ProcessGroup itself
        dist.Backend.register_backend("gradsync", _create)


class _GradsyncStore(dist.Store):
    """The only store traffic torch makes for a plugin backend is the barrier at the end of
    init_process_group/new_group (add(key, 1) on every rank, then add(key, 0) until it reads the
    world size). add(key, n != 0) is that barrier's allreduce over the newest gradsync group;
    anything else is refused with a clear error instead of hanging."""

    def __init__(self):
        super().__init__()
        self._values = {}

    def add(self, key, amount):
        if amount != 0:
            if not _groups:
                raise RuntimeError("gradsync store: no gradsync process group to count ranks with")
            self._values[key] = self._values.get(key, 0) + _groups[-1]._store_add(amount)
        return self._values.get(key, 0)

    def set(self, key, value):
        self._values[key] = value

    def get(self, key):
        if key not in self._values:
            raise RuntimeError(f"gradsync store: key {key!r} was never set in this process; the gradsync "
                               "store is not shared between ranks (use another store for that)")
        return self._values[key]

    def wait(self, keys, timeout=None):
        missing = [k for k in keys if k not in self._values]
        if missing:
            self.get(missing[0])

    def check(self, keys):
        return all(k in self._values for k in keys)

    def num_keys(self):
        return len(self._values)

    def delete_key(self, key):
        return self._values.pop(key, None) is not None

    def set_timeout(self, timeout):
        pass


def init_process_group(timeout=timedelta(minutes=5), **kwargs):
    """torch.distributed.init_process_group("gradsync") with gradsyncrun's rank and world size
    and a store that needs no server."""
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gradsync", store=_GradsyncStore(), rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)


register()
