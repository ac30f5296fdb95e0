"""Moving a training model's memory to the host and back (colocated mode: the actor and the rollout
engine take turns with the GPU memory).

:class:`HostOffload` holds one host copy of each device storage it was given, by storage: views of
one storage (the parameters inside megatron's contiguous DDP buffer, the gradients inside its
gradient buffer) move once and stay valid, because the storage object stays and only its memory
goes (``untyped_storage().resize_(0)``) and comes back (``resize_(nbytes)``, then the copy), the
way megatron's own ``_ParamAndGradBuffer.offload_to_cpu`` frees a buffer. The host copies are one
block per offload, allocated once and sliced per storage (:func:`host_block`), page-locked on CUDA
by registering exactly its bytes with the driver (``cudaHostRegister``: torch's pinned allocator
would round every allocation up to a power of two, up to 2x what is moved: 16 GiB for the 14B's
13.8 GiB gradient buffer), so the copies run at the link's speed, asynchronously; the pinned bytes
are :attr:`HostOffload.pinned_bytes`, what the fit check prices. Reused by every later offload. :meth:`HostOffload.offload` returns once the device memory is free (the
copies done, the allocator's cache emptied), so another process can take it;
:meth:`HostOffload.onload` once the data is back.

Unlike megatron's helpers, gradients are copied, not dropped: what comes back is bit-identical,
whatever was offloaded. On CPU the same code runs (the "device" storages are host memory; they are
freed and refilled all the same), which is what the CPU tests check.

Left out: choosing what to offload (the fit check's), activations and caches (none outlive a
step), and overlapping the copies with compute.
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Tuple

import torch

__all__ = ["HostOffload", "host_block"]

_ALIGN = 512  # each storage's slice of the block starts on this many bytes (the copies' alignment)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_block(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory in one tensor; ``pin``: page-locked by registering exactly those
    bytes with the CUDA driver (unregistered when the tensor is freed), else torch's pinned
    allocator if the driver refuses (logged: it rounds up to a power of two)."""
    block = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
    if not pin or not nbytes:
        return block
    err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)
    if int(getattr(err, "value", err)) != 0:
        import logging

        logging.getLogger(__name__).warning("cudaHostRegister of %d bytes failed (%s): the host copies use torch's "
                                            "pinned allocator, which rounds them up to a power of two", nbytes, err)
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)
    weakref.finalize(block.untyped_storage(), _unregister, block.data_ptr())
    return block


class HostOffload:
    """Host copies of a fixed set of device storages (see the module docstring). ``tensors``: every
    tensor whose storage moves (views of one storage count once; empty storages are skipped)."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self._storages: Dict[int, Tuple[torch.UntypedStorage, int]] = {}
        for t in tensors:
            s = t.untyped_storage()
            if s.nbytes() and s._cdata not in self._storages:  # _cdata: the storage itself, whatever its memory
                self._storages[s._cdata] = (s, s.nbytes())
        self._host: List[torch.Tensor] = []  # each storage's slice of one host block
        self._block_bytes = 0
        self.pinned_bytes = 0  # page-locked host bytes this offload holds (0 on CPU)
        self.offloaded = False

    def holds(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether ``tensors`` are exactly the storages this offload moves (its host copies fit them)."""
        keys = {t.untyped_storage()._cdata for t in tensors if t.untyped_storage().nbytes()}
        return keys == set(self._storages)

    @property
    def nbytes(self) -> int:
        """The bytes that move each way."""
        return sum(n for _, n in self._storages.values())

    def __len__(self) -> int:
        return len(self._storages)

    def offload(self) -> None:
        """Copy every storage to its host copy and free its device memory; returns when it is free."""
        if self.offloaded:
            return
        items = list(self._storages.values())
        cuda = any(s.device.type == "cuda" for s, _ in items)
        if not self._host:
            offsets, end = [], 0
            for _, n in items:
                offsets.append(end)
                end += -(-n // _ALIGN) * _ALIGN
            block = host_block(end, pin=cuda)
            self._host = [block[o:o + n] for o, (_, n) in zip(offsets, items)]
            self._block_bytes, self.pinned_bytes = end, end if cuda else 0
        for (s, n), host in zip(items, self._host):
            if s.device.type == "cpu":
                host.copy_(_byte_view(s))
            else:
                host.copy_(_byte_view(s), non_blocking=True)
        if cuda:
            torch.cuda.synchronize()  # the copies are done before the memory goes
        for s, _ in items:
            s.resize_(0)
        if cuda:
            torch.cuda.empty_cache()  # back to the driver: another process can allocate it
        self.offloaded = True

    def onload(self) -> None:
        """Give every storage its memory back and copy its data in; returns when the data is there."""
        if not self.offloaded:
            return
        items = list(self._storages.values())
        for (s, n), host in zip(items, self._host):
            s.resize_(n)
            _byte_view(s).copy_(host, non_blocking=s.device.type == "cuda")
        if any(s.device.type == "cuda" for s, _ in items):
            torch.cuda.synchronize()
        self.offloaded = False
