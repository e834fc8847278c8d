"""The compiled part of the transport (csrc/megadpp_transport) and the handle over its requests."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch  # first: loads libc10/libtorch, which the CUDA IPC extension links against

from megadpp.transport.base import Handle, TransferEvent, TransferObserver
from megatron.training.errors import UserError
from megatron.training.training_log import print_whole_line


class TransportSetupError(UserError):
    """The transport cannot start here (not built, /dev/shm too small): one line, exit code 2."""


BUILD_HINT = ("build it in the repository with `pip install --no-build-isolation -e .` "
              "(or `python3 setup.py build_ext --inplace`)")


def _load(name):
    """The compiled module, or None and why not. By its full name, not ``from megadpp.transport import``:
    a module that was never built must read as missing, not as the package's partial initialisation."""
    try:
        return importlib.import_module(f"megadpp.transport.{name}"), None
    except ModuleNotFoundError as error:
        if error.name != f"megadpp.transport.{name}":  # the module is there, a library it needs is not
            return None, f"built but not loadable ({error})"
        return None, "not built"
    except ImportError as error:  # built against another torch or CUDA, a missing symbol, ...
        return None, f"built but not loadable ({error})"


_shm, _SHM_MISSING = _load("_shm")
_cuda_ipc, _CUDA_IPC_MISSING = _load("_cuda_ipc")
if _cuda_ipc is None:
    if _CUDA_IPC_MISSING == "not built":
        _CUDA_IPC_MISSING += " (it is built only where CUDA's compiler is found at build time)"
    # One line per node (not per rank), on stdout: stderr carries a failed launch's single error line.
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print_whole_line(f"megadpp transport: CUDA IPC part {_CUDA_IPC_MISSING}; shared memory and "
                         "torch.distributed transports only")


def shm_module() -> ModuleType:
    """The shared-memory part of the extension; TransportSetupError saying how to build it when missing."""
    if _shm is None:
        raise TransportSetupError(f"megadpp transport: the shared-memory part of the C++ extension is {_SHM_MISSING}; "
                                  f"{BUILD_HINT}")
    return _shm


def cuda_ipc_module() -> ModuleType:
    """The CUDA IPC part of the extension; TransportSetupError saying how to build it when missing."""
    if _cuda_ipc is None:
        raise TransportSetupError(f"megadpp transport: the CUDA IPC part, which moves DPP's tensors between the GPUs "
                                  f"of a node, is {_CUDA_IPC_MISSING}; {BUILD_HINT} on a machine with CUDA's "
                                  f"compiler (nvcc)")
    return _cuda_ipc


class NativeHandle(Handle):
    """A send or receive carried out by a C++ channel thread; reports itself to the observer once."""

    __slots__ = ("_request", "_op", "peer", "_observer", "_sent", "_taken", "label")

    def __init__(self, request: Any, op: str, peer: int, observer: TransferObserver | None,
                 sent: torch.Tensor | None = None):
        self._request = request
        self._op = op
        self.peer = peer
        self._observer = observer
        self._sent = sent  # a send returns the caller's tensor, not the contiguous copy it sent
        self._taken = False  # the request's tensor is taken (made ready for the taker's stream) once
        self.label = None

    def is_completed(self) -> bool:
        if not self._request.is_completed():
            return False
        self._finish()
        return True

    @property
    def end_ns(self) -> int:
        return self._request.end_ns

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if not self._request.wait(-1.0 if timeout is None else float(timeout)):
            raise TimeoutError(f"megadpp transport: {self._op} with rank {self.peer} (tag {self._request.tag}) "
                               f"not done after {timeout} s")
        return self._finish()

    def _finish(self):
        request = self._request
        if request.error:
            raise RuntimeError(request.error)
        if self._observer is not None:
            observer, self._observer = self._observer, None
            observer(TransferEvent(self._op, self.peer, request.nbytes, request.seq, request.tag,
                                   request.start_ns, request.end_ns, self.label))
        if not self._taken:
            # CUDA IPC: the taker's stream is ordered after the receiver's copy (cuda_ipc_transport.cpp), and a
            # received tensor's memory is marked as used on that stream.
            self._taken = True
            request.take()
        return self._sent if self._op == "send" else request.tensor
