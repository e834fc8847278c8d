"""Device tensors on their way to the host: the copies are queued behind the work that computes them, and only a
reader waits for them, so the host can queue more work first."""

import torch


class HostCopy:
    """``tensors`` (name -> device tensor) copied into fresh host memory (pinned on a GPU, so the copies run
    asynchronously); ``tensors()`` waits for them and returns name -> host tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._host = {}
        cuda = any(tensor.is_cuda for tensor in tensors.values())
        for name, tensor in tensors.items():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
            host.copy_(tensor, non_blocking=cuda)
            self._host[name] = host
        self._ready = None
        if cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host
