"""Build and install MegatronApp (metadata lives in pyproject.toml).

Kept as a setup.py because the C++ extensions of csrc/ are built here; it must install on a
machine without CUDA, where CUDA-only extensions are skipped (megadpp.transport says so at import).
torch must already be installed: scripts/install.sh builds with --no-build-isolation against it.
"""

import os

from setuptools import setup
from torch.utils import cpp_extension

TRANSPORT_SOURCES = "csrc/megadpp_transport"
# The C++ standard is the one torch builds with; no debug info (a 7 MB module, and a slower build).
COMPILE_ARGS = {"cxx": ["-O3", "-g0"], "nvcc": ["-O3"]}


def transport_extensions():
    extensions = [cpp_extension.CppExtension(
        "megadpp.transport._shm", [f"{TRANSPORT_SOURCES}/shm_transport.cpp"],
        extra_compile_args=COMPILE_ARGS, libraries=["rt"])]
    if cpp_extension.CUDA_HOME is not None and os.environ.get("MEGADPP_BUILD_CUDA", "1") != "0":
        extensions.append(cpp_extension.CUDAExtension(
            "megadpp.transport._cuda_ipc", [f"{TRANSPORT_SOURCES}/cuda_ipc_transport.cpp"],
            extra_compile_args=COMPILE_ARGS, libraries=["rt"]))
    return extensions


setup(
    ext_modules=transport_extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)},
)
