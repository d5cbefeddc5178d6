"""YAML as the config reads it: one loader, and a single value typed on a command line.

`YamlLoader` is PyYAML's SafeLoader that also reads `1e-5` as a float (YAML 1.1 wants
`1.0e-5`; 1.2 does not); the config files and every override go through it
(config/loading.py), and so do `--set key=value` model-config values (model/loading.py).
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class YamlLoader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-5` as a float."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def parse_yaml_value(text: str) -> Any:
    """A command-line value read as YAML (`false`, `False`, `1e-5`, `[1, 2]`); the raw text
    where it is not valid YAML."""
    try:
        return yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError:
        return text
