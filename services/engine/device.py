"""Host <-> device transfers of a step, without hidden synchronisations on CUDA.

`torch.tensor(list, device="cuda")` copies from pageable memory, which waits for the stream
(a host synchronisation per call); a boolean-mask index or `.tolist()` of a CUDA tensor does
too. The runner and sampler move data only through these two functions, so a CUDA step
synchronises once: in `to_host`, when the sampled tokens are read. On the CPU both are the
plain calls they replace (same tensors, same values). `HostCopy` splits `to_host` in two: the
copies are queued now and waited for later, so the host can work while the device does.
"""
from __future__ import annotations

import torch


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def to_device(values, dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A list (or CPU tensor) as a tensor on `device`. CUDA: staged in pinned memory and
    copied asynchronously (the caching host allocator keeps the stage until the copy ran)."""
    if not is_cuda(device):
        if isinstance(values, torch.Tensor):
            return values.to(dtype=dtype)
        return torch.tensor(values, dtype=dtype, device=device)
    host = values.to(dtype=dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if host.numel() == 0:
        return torch.empty(host.shape, dtype=dtype, device=device)
    return host.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Tensors on their way to the host: `start_to_host` queues the copies, `wait` reads them.
    Between the two the host is free while the device finishes the step (the overlapped step
    loop emits the previous step's tokens there)."""

    def __init__(self, tensors: list[torch.Tensor]):
        """Queues the copies (nothing is read yet)."""
        self._cuda = bool(tensors) and tensors[0].is_cuda
        if not self._cuda:
            self._tensors = tensors
            return
        self._tensors = [t.to("cpu", non_blocking=True) for t in tensors]  # pinned destinations
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(tensors[0].device))

    def wait(self) -> list[list]:
        """`.tolist()` of each tensor, once the device has written them."""
        if self._cuda:
            self._done.synchronize()  # the step's one wait (an event: torch's sync debug mode counts the rest)
        return [t.tolist() for t in self._tensors]


def to_host(tensors: list[torch.Tensor]) -> list[list]:
    """`.tolist()` of each tensor; on CUDA all copies are queued first, then one wait."""
    return HostCopy(tensors).wait()
