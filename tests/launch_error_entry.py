"""The smallest entry point with the launch-error handling of pretrain_gpt.py: every rank fails its
flag check at once. Starts in milliseconds (no torch), so a test can launch it many times."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.training.errors import ArgumentError, exit_on_user_error  # noqa: E402


@exit_on_user_error
def main():
    raise ArgumentError("--trace-dir /tmp/a_file exists and is not a directory")


if __name__ == "__main__":
    main()
