"""Host memory for many tensors in one piece, page-locked with one ``cudaHostRegister``.

Offloaded units and checkpoint staging copy GBs between a GPU and the host. torch's pinned
allocator (``cudaHostAlloc``) took 5.1 s to allocate 5.9 GB on an H200 host, 1.8 s to free it, and
held, 1.9 s more at process exit; DCP's stager registers each tensor's memory on its own (2.8 s).
One anonymous mapping whose pages are touched from several threads and then registered in one call
took 0.66-1.77 s (three H200 hosts), its release 0.1 s, and held, 0.56-1.05 s at exit
(``benchmarks/gpu_dcp_write.py --staging-only``). Each tensor gets a storage of its own over its part of the
mapping: DCP's writer clones a tensor that views a larger storage.
"""

from __future__ import annotations

import mmap
import warnings
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

PAGE = 4096
ALIGN = 256  # each tensor's offset: a multiple of every element size, and of a cache line
PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
TOUCH_THREADS = 8  # page faults are taken in parallel (torch's pinned_num_register_threads)


def _offsets(like: Sequence[Tensor]) -> tuple[list[int], int]:
    """Each tensor's byte offset in the block and the block's size (a whole number of pages)."""
    offsets, end = [], 0
    for tensor in like:
        offsets.append(end)
        end += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return offsets, max(PAGE, -(-end // PAGE) * PAGE)


def _touch(memory: Tensor) -> None:
    """Fault every page of ``memory`` in, from several threads (torch ops release the GIL)."""
    pages = memory.view(-1, PAGE)
    chunks = pages.chunk(TOUCH_THREADS)
    with ThreadPoolExecutor(len(chunks)) as pool:
        list(pool.map(lambda chunk: chunk[:, 0].zero_(), chunks))


def _carve(mapping: mmap.mmap, offset: int, like: Tensor) -> Tensor:
    """A contiguous tensor shaped like ``like`` over ``mapping`` at ``offset``, with a storage of its own."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    flat = torch.frombuffer(mapping, dtype=like.dtype, count=like.numel(), offset=offset)
    return flat.view(like.shape)


def _unregister(address: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy may still read or write the memory
    torch.cuda.cudart().cudaHostUnregister(address)


class HostBlock:
    """Contiguous host tensors shaped like ``like`` (same dtypes and shapes), page-locked when ``pin``.

    Attributes:
        tensors: One host tensor per entry of ``like``, each over its own part of one mapping.
        pinned: Whether the allocation is registered with CUDA (copies to and from it are
            asynchronous and run at the link's speed).
    """

    def __init__(self, like: Sequence[Tensor], pin: bool) -> None:
        offsets, size = _offsets(like)
        self._mapping = mmap.mmap(-1, size)
        self._memory = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.tensors = [_carve(self._mapping, o, t) for o, t in zip(offsets, like, strict=True)]
        self.pinned = pin and self._register()
        if self.pinned:
            # The copies into and out of the block run on the GPU of ``like``; releasing waits for that GPU's,
            # from whichever thread releases it (a fresh thread's current device is GPU 0).
            on_gpu = [t.device for t in like if t.is_cuda]
            device = on_gpu[0] if on_gpu else torch.device("cuda", torch.cuda.current_device())
            # Unregistered before the memory is unmapped: the block holds the mapping, so it dies first.
            self._release = weakref.finalize(self, _unregister, self._memory.data_ptr(), device)
            self._release.atexit = False  # at exit the kernel takes the pages back without it

    def _register(self) -> bool:
        _touch(self._memory)
        status = torch.cuda.cudart().cudaHostRegister(self._memory.data_ptr(), self._memory.numel(), PORTABLE)
        if int(status) != 0:
            warnings.warn(
                f"cudaHostRegister of {self._memory.numel() / 1e9:.2f} GB failed ({status}): host copies "
                "use pageable memory (slower); is the locked-memory limit (ulimit -l) too low?",
                stacklevel=3,
            )
            return False
        return True

    def holds(self, like: Sequence[Tensor]) -> bool:
        """Whether the block's tensors have ``like``'s shapes and dtypes, in order."""
        return len(like) == len(self.tensors) and all(
            h.shape == t.shape and h.dtype == t.dtype for h, t in zip(self.tensors, like, strict=True)
        )

    def release(self) -> None:
        """Unregister the memory now, once the copies on its GPU have finished (from any thread; the memory
        is unmapped once neither the block nor any of its tensors is referenced).
        """
        if self.pinned:
            self._release()
