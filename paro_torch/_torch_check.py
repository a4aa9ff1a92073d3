"""Refuses, on import, a torch of another minor version than the one paro_torch._C was compiled against.

libtorch has no stable C++ ABI across minor versions: an extension built against one may fail to load against
another with an undefined symbol, or load and misbehave. The extension carries the version it was built against
(see rust/paro-ext/src/lib.rs); it is read here from the file's bytes, before the file is loaded.
"""

import importlib.util
import re

import torch


def check() -> None:
    """Raises ImportError, naming both versions and the rebuild command, when the torch minors differ."""
    spec = importlib.util.find_spec("paro_torch._C")
    if spec is None or not spec.origin:
        return  # importing it says what is missing
    with open(spec.origin, "rb") as f:
        found = re.search(rb"paro-torch-built-with torch==([^\n\0]+)\n", f.read())
    if found is None:
        return  # built before the extension carried its torch version
    built, running = found.group(1).decode(), torch.__version__
    if built.split(".")[:2] != running.split(".")[:2]:
        minor = ".".join(built.split(".")[:2])
        raise ImportError(
            f"paro_torch's extension ({spec.origin}) was built against torch {built}, but torch {running} is "
            f"installed. Rebuild paro-torch against this torch:\n"
            f"    pip install --no-build-isolation --no-deps --force-reinstall --no-binary paro-torch paro-torch\n"
            f"(in a source checkout: pip install --no-build-isolation --no-deps --force-reinstall .), "
            f"or install torch {minor}.*"
        )


check()
