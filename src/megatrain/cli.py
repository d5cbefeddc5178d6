"""The `megatrain` command: dispatch to megatrain.commands, and print user errors as one line.

    megatrain train    --config FILE [--section.key VALUE ...]
    megatrain verify   --config FILE | MODEL | --model-type NAME --tiny  [--steps N] [...]
    megatrain estimate --config FILE | --model MODEL --seq-len N [...]
    megatrain data     --config FILE --show N [--json]
    megatrain export   --checkpoint DIR --out DIR

`python -m megatrain` is the same command. Errors a user can fix (bad path, bad key,
unsupported model) print one paragraph naming what to change and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version

from megatrain.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatrain",
        description="Full-precision training of large HF causal LMs, streaming layers from "
        "host RAM through the GPU.",
    )
    parser.add_argument("--version", action="version", version=f"megatrain {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = rest
    try:
        return int(args.run(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"megatrain {args.command}: error: {e}", file=sys.stderr)
        return 2


def _version() -> str:
    try:
        return version("megatrain")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
