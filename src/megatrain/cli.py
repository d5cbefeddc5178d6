"""The `megatrain` command: dispatch to megatrain.commands, and print user errors as one line.

    megatrain train    --config FILE [--section.key VALUE ...] [--print-config]
    megatrain grpo     --config FILE [--section.key VALUE ...]
    megatrain dpo      --config FILE [--section.key VALUE ...] [--print-config]
    megatrain verify   --config FILE | MODEL | --model-type NAME --tiny  [--steps N] [...]
    megatrain estimate --config FILE | --model MODEL --seq-len N [...]
    megatrain data     --config FILE --show N [--json]
    megatrain export   --checkpoint DIR --out DIR
    megatrain config   --list [SECTION]

FILE is a MegaTrain config, or a LLaMA-Factory / TRL training file (config/llamafactory.py).
`python -m megatrain` is the same command. Errors a user can fix (bad path, bad key,
unsupported model, disk full) print one paragraph naming what to change and exit 2; Ctrl-C prints
where the last checkpoint is and exits 130. MEGATRAIN_DEBUG=1 shows the traceback instead.

Invariant: parsing imports neither torch nor transformers (the commands import them when they
run), so `--help`, `--version` and usage errors answer in a fraction of a second, and so do
config errors of train, grpo, dpo, data and export (tests/test_cli_startup.py; bench/cli_startup.py
times it).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from importlib.metadata import PackageNotFoundError, version

from megatrain.allocator import configure_allocator
from megatrain.commands import COMMANDS
from megatrain.config import SECTIONS
from megatrain.config.aliases import alias_hint
from megatrain.config.loading import setup_command
from megatrain.config.types import field_types
from megatrain.errors import MissingPath, RunStopped


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
    argv = sys.argv[1:] if argv is None else argv
    overrides, rest = split_overrides(argv, options=_dotted_options(parser))
    args, unknown = parser.parse_known_args(rest)
    if unknown:
        parser.error(_unrecognized(unknown))
    if overrides and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    configure_allocator()  # before any command touches CUDA
    debug = os.environ.get("MEGATRAIN_DEBUG", "") not in ("", "0")
    try:
        return int(args.run(args))
    except (ValueError, OSError) as e:  # OSError: its message names the file (disk full, ...)
        if debug:
            raise
        print(f"megatrain {args.command}: error: {e}{_setup_hint(e, args)}", file=sys.stderr)
        if _may_need_traceback(e):
            print("(MEGATRAIN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2
    except RunStopped as e:  # its message is the paragraph (out of GPU memory, ...)
        if debug:
            raise
        print(f"megatrain {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # the trainer's says where the last checkpoint is
        if debug:
            raise
        print(f"megatrain {args.command}: {str(e) or 'interrupted'}", file=sys.stderr)
        return 130


def split_overrides(
    argv: list[str], options: frozenset[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """(`--section.key VALUE` config overrides, the command's own arguments).

    An override is a dotted name (`--optimizer.learning_rate 2e-5`, or with `=`) other than a
    command's own dotted `options` (`--verify.steps`); its value is the next token. Taken out
    before argparse sees the rest, so a value is never mistaken for a positional argument, and
    an unknown section (`--lora.r 8`) gets the config's paragraph, not argparse's usage.
    """
    overrides: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token[2:].partition("=")[0] if token.startswith("--") else ""
        if _DOTTED.fullmatch(name) and f"--{name}" not in options:
            takes_next = "=" not in token and i + 1 < len(argv)
            overrides += argv[i : i + 2] if takes_next else [token]
            i += 2 if takes_next else 1
        else:
            rest.append(token)
            i += 1
    return overrides, rest


_DOTTED = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)+")
"""An override's name: `section.key`, or `section.key.sub` for a mapping's entry."""


def _dotted_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The commands' own option strings with a dot in them (`--verify.steps`)."""
    commands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return frozenset(
        option
        for sub in commands
        for command in sub.choices.values()
        for action in command._actions
        for option in action.option_strings
        if "." in option
    )


def _unrecognized(unknown: list[str]) -> str:
    """argparse's message, and for a flat key (`--learning_rate`) the config key it means."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    for token in unknown:
        name = token[2:].partition("=")[0].replace("-", "_") if token.startswith("--") else ""
        owners = [f"{s}.{name}" for s, cls in SECTIONS.items() if name in field_types(cls)]
        hint = f"did you mean --{owners[0]}?" if owners else alias_hint(name, "--")
        if hint:
            return f"{message}; config keys are given as --section.key VALUE: {hint}"
    return message


def _setup_hint(e: Exception, args: argparse.Namespace) -> str:
    """For a missing path the config's header says how to make: that command."""
    config = getattr(args, "config", None)
    if not isinstance(e, MissingPath) or not config:
        return ""
    command = setup_command(config, e.path)
    return f". {config}'s header makes it first: `{command}`" if command else ""


def _may_need_traceback(e: Exception) -> bool:
    """An OSError other than a missing file or a full disk: its message may not say enough."""
    if not isinstance(e, OSError) or isinstance(e, FileNotFoundError):
        return False
    from megatrain.disk_space import DiskFullError

    return not isinstance(e, DiskFullError)


def _version() -> str:
    try:
        return version("megatrain")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
