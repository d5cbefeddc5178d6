"""`megatrain config --list [SECTION]`: every config key with its type, default and meaning.

The same rows as docs/configuration.md (megatrain.config.reference renders both from the config
dataclasses), so an installed wheel, which ships no docs/, still answers "which keys are there".
Imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import shutil
import textwrap

from megatrain.config import SECTIONS
from megatrain.config.reference import section_keys, section_summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "config",
        help="list the config keys (type, default, meaning)",
        description="Print every key a run's YAML file takes (or those of SECTION), with its "
        "type, default and meaning: the reference of docs/configuration.md.",
    )
    p.add_argument("--list", action="store_true", required=True, help="list the keys")
    p.add_argument("section", nargs="?", choices=list(SECTIONS), help="only this section's keys")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    width = min(shutil.get_terminal_size((100, 20)).columns, 100)
    for n, section in enumerate([args.section] if args.section else SECTIONS):
        print(("\n" if n else "") + format_section(section, width), end="")
    return 0


def format_section(section: str, width: int = 100) -> str:
    """`section:`, its summary, then each key as `  section.key  (TYPE; default DEFAULT)` and
    its meaning wrapped below it."""
    lines = [f"{section}:"]
    summary = section_summary(section)
    if summary:
        lines += textwrap.wrap(summary, width, initial_indent="  ", subsequent_indent="  ")
    for key, type_, default, meaning in section_keys(section):
        lines.append(f"  {section}.{key}  ({type_}; default {default})")
        lines += textwrap.wrap(meaning, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"
