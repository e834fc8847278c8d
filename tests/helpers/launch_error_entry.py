"""The smallest entry point with the launch-error handling of pretrain_gpt.py: every rank fails its
flag check at once. Starts in milliseconds (no torch), so a test can launch it many times."""

from megatron.training.errors import ArgumentError, exit_on_user_error


@exit_on_user_error
def main():
    raise ArgumentError("--trace-dir /tmp/a_file exists and is not a directory")


if __name__ == "__main__":
    main()
