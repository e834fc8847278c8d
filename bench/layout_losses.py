"""Compare the losses and grad norms that pretrain_gpt.py logged (--log-interval 1) under several parallel
layouts with a reference run's, iteration by iteration: the table bench/gpu_layout_losses.sh prints.

    python bench/layout_losses.py REFERENCE.log NAME=LOG [NAME=LOG ...] [--rtol 5e-3]

A layout passes when every iteration's lm loss and grad norm are within --rtol (relative, default 5e-3) of the
reference's and it logged as many iterations; bf16 layouts differ from one GPU by about 1e-4.
"""

import argparse
import re
import sys

LINE = re.compile(r"iteration +(\d+)/.*?lm loss: ([0-9.Ee+-]+).*?grad norm: ([0-9.Ee+-]+)")


def logged(path):
    """iteration -> (lm loss, grad norm), from one log (any rank's lines: they are the same)."""
    found = {}
    with open(path, errors="replace") as log:
        for line in log:
            match = LINE.search(line)
            if match:
                found[int(match.group(1))] = (float(match.group(2)), float(match.group(3)))
    return found


def relative(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("runs", nargs="+", metavar="NAME=LOG")
    parser.add_argument("--rtol", type=float, default=5e-3)
    options = parser.parse_args()
    reference = logged(options.reference)
    if not reference:
        sys.exit(f"error: {options.reference}: no 'iteration ... lm loss ... grad norm' lines (--log-interval 1?)")
    print(f"reference: {options.reference}, {len(reference)} iterations")
    print("| layout | iterations | largest loss difference | largest grad-norm difference | verdict |")
    print("|---|---|---|---|---|")
    failed = False
    for run in options.runs:
        name, _, path = run.partition("=")
        values = logged(path)
        common = sorted(set(values) & set(reference))
        loss = max((relative(values[i][0], reference[i][0]) for i in common), default=float("nan"))
        norm = max((relative(values[i][1], reference[i][1]) for i in common), default=float("nan"))
        ok = len(values) == len(reference) and loss <= options.rtol and norm <= options.rtol
        failed |= not ok
        print(f"| {name} | {len(values)} | {loss:.2e} | {norm:.2e} | {'equal' if ok else 'DIFFERENT'} |")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
