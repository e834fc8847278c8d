"""Build and install MegatronApp (metadata lives in pyproject.toml).

Kept as a setup.py because the C++ extensions of csrc/ are built here; it must install on a
machine without CUDA, where CUDA-only extensions are skipped.
"""

from setuptools import setup

setup()
