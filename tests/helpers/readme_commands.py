"""The commands README.md shows a newcomer, as argument lists, so that tests run exactly those (with their
outputs moved into the test's directory)."""

import re
import shlex
import sys

from helpers.launch import REPO
from megatron.training.ports import free_port


def readme_commands(heading):
    """Every command of the first code block under ``heading`` (a README section title), each an argument
    list; a backslash at a line's end continues the command on the next line."""
    text = (REPO / "README.md").read_text()
    section = text[text.index(f"\n## {heading}\n"):]
    block = re.search(r"\n```\n(.*?)\n```", section, re.DOTALL).group(1)
    return [shlex.split(command) for command in block.replace("\\\n", " ").splitlines()]


def as_launched(command, replacements):
    """``command`` with ``python`` as this interpreter, ``torchrun`` as its module on a free rendezvous port
    (tests run side by side: --standalone or one chosen here), and each flag in ``replacements``
    ({flag: value}) given that value; a flag it lacks is refused."""
    command = list(command)
    for flag, value in replacements.items():
        assert flag in command, f"README's command has no {flag}: {command}"
        command[command.index(flag) + 1] = str(value)
    if command[0] == "torchrun":  # a free rendezvous port, unless the command asks torchrun for one
        own = "--standalone" in command or "--rdzv-endpoint" in command
        rendezvous = [] if own else ["--master-port", str(free_port())]
        command[:1] = [sys.executable, "-m", "torch.distributed.run", *rendezvous]
    elif command[0] == "python":
        command[0] = sys.executable
    return command
