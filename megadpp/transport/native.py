"""The compiled part of the transport (csrc/megadpp_transport) and the handle over its requests."""

import os

import torch  # noqa: F401  first: loads libc10/libtorch, which the CUDA IPC extension links against

from megadpp.transport.base import Handle, TransferEvent
from megatron.training.errors import UserError


class TransportSetupError(UserError):
    """The transport cannot start here (not built, /dev/shm too small): one line, exit code 2."""


try:
    from megadpp.transport import _shm
except ImportError as error:  # an install without the build step
    _shm = None
    _SHM_MISSING = str(error)

try:
    from megadpp.transport import _cuda_ipc
except ImportError as error:
    _cuda_ipc = None
    # Not built (no CUDA at build time) or built but not loadable here: say which.
    _CUDA_IPC_MISSING = ("not built (no CUDA at build time)" if isinstance(error, ModuleNotFoundError)
                         else f"built but not loadable ({error})")
    # One line per node (not per rank), on stdout: stderr carries a failed launch's single error line.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"megadpp transport: CUDA IPC part {_CUDA_IPC_MISSING}; shared memory and "
              "torch.distributed transports only", flush=True)


def shm_module():
    if _shm is None:
        raise TransportSetupError(f"megadpp transport: the C++ extension is not built ({_SHM_MISSING}); "
                                  "run `pip install --no-build-isolation -e .` in the repository")
    return _shm


def cuda_ipc_module():
    if _cuda_ipc is None:
        raise TransportSetupError(f"megadpp transport: CUDA IPC is {_CUDA_IPC_MISSING} in this install; "
                                  "reinstall on a machine with nvcc, or use the distributed transport")
    return _cuda_ipc


class NativeHandle(Handle):
    """A send or receive carried out by a C++ channel thread; reports itself to the observer once."""

    __slots__ = ("_request", "_op", "_peer", "_observer", "_sent", "label")

    def __init__(self, request, op, peer, observer, sent=None):
        self._request = request
        self._op = op
        self._peer = peer
        self._observer = observer
        self._sent = sent  # a send returns the caller's tensor, not the contiguous copy it sent
        self.label = None

    def is_completed(self):
        if not self._request.is_completed():
            return False
        self._finish()
        return True

    @property
    def end_ns(self):
        return self._request.end_ns

    def wait(self, timeout=None):
        if not self._request.wait(-1.0 if timeout is None else float(timeout)):
            raise TimeoutError(f"megadpp transport: {self._op} with rank {self._peer} (tag {self._request.tag}) "
                               f"not done after {timeout} s")
        return self._finish()

    def _finish(self):
        request = self._request
        if request.error:
            raise RuntimeError(request.error)
        if self._observer is not None:
            observer, self._observer = self._observer, None
            observer(TransferEvent(self._op, self._peer, request.nbytes, request.seq, request.tag,
                                   request.start_ns, request.end_ns, self.label))
        return self._sent if self._op == "send" else request.tensor
