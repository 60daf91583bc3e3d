"""The one exception type users meet. The CLI prints its message on one line and exits 2."""

from __future__ import annotations

import importlib.util
import re
from importlib import metadata


class SpearError(Exception):
    """A problem the user can fix: bad path, unsupported model, impossible setting."""


def first_line(e: BaseException) -> str:
    """An exception's message cut to its first line (its type's name where it has none), for a SpearError."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def _project(requirement: str) -> str:
    """'compressed-tensors>=0.20' → 'compressed-tensors'."""
    return re.match(r"[\w.-]+", requirement).group()


def optional_requirement(module: str) -> str | None:
    """The requirement, as an extra of pyproject.toml states it ('compressed-tensors>=0.20'), of the optional
    dependency that installs `module` (or a submodule of it); None where no extra lists it."""
    name = module.partition(".")[0].replace("_", "-").lower()
    try:
        requires = metadata.requires("spear") or []
    except metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return None
    for line in requires:
        requirement, _, marker = (part.strip() for part in line.partition(";"))
        if "extra ==" in marker and _project(requirement).replace("_", "-").lower() == name:
            return requirement
    return None


def require_module(module: str, needed_by: str) -> None:
    """Where `module`, an optional dependency, is not installed: a SpearError saying what to install."""
    if importlib.util.find_spec(module) is None:
        requirement = optional_requirement(module) or module.replace("_", "-")
        raise SpearError(f"{needed_by} needs {_project(requirement)}: pip install '{requirement}'")
