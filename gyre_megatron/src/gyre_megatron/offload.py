"""Offload and restore a cell's training state in place (the *leave/enter training* hooks).

Tensors keep their identity: each unique storage (parameters, DDP grad buffers, optimizer state,
module buffers) is copied to host memory and then resized to zero bytes, which frees the device
memory (on GPUs after ``empty_cache``); restoring resizes and copies back. Because every view
(``param.main_grad`` into the grad buffer, the optimizer's references to parameters) points at the
same storage object, nothing has to be re-wired, and processes and process groups stay alive.
On CPU the "device" and "host" are both main memory; the round trip is still a real release
(the storage is emptied) and is bit-exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

__all__ = ["Offloader"]


def _bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))


@dataclass
class Offloader:
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    offloaded: bool = False

    @staticmethod
    def collect(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = st
        return list(seen.values())

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move ``tensors``' storages to host memory; return the bytes released."""
        if self.offloaded:
            raise RuntimeError("already offloaded")
        self.storages = self.collect(tensors)
        pin = torch.cuda.is_available()
        self.host = []
        released = 0
        bad = [st for st in self.storages if not st.resizable()]
        if bad:
            raise RuntimeError(f"{len(bad)} storages cannot be released in place: {[b.nbytes() for b in bad]}")
        for st in self.storages:
            h = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=pin and st.device.type == "cuda")
            h.copy_(_bytes_view(st))
            self.host.append(h)
            released += st.nbytes()
            st.resize_(0)
        if pin:
            torch.cuda.empty_cache()
        self.offloaded = True
        return released

    def host_view(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself, or while offloaded a CPU tensor over its host copy (same dtype, offset,
        size, stride): reading an offloaded parameter without bringing it back to the device.
        Colocate's core publishes after its burst, when the whole pool has left training."""
        if not self.offloaded:
            return t
        key = t.untyped_storage()._cdata  # resized storages keep their identity, not their pointer
        for st, h in zip(self.storages, self.host):
            if st._cdata == key:
                return torch.empty(0, dtype=t.dtype).set_(h.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        raise KeyError("tensor is not part of the offloaded state")

    def restore(self) -> int:
        if not self.offloaded:
            return 0
        restored = 0
        for st, h in zip(self.storages, self.host):
            st.resize_(h.numel())
            _bytes_view(st).copy_(h)
            restored += h.numel()
        self.storages, self.host, self.offloaded = [], [], False
        return restored
