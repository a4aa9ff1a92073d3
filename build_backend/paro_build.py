"""paro-torch's build backend: maturin's, plus what a torch extension needs.

paro_torch._C links libtorch and includes its headers, so it must be compiled against the very torch it will run
with. That torch is the one installed in the environment paro-torch is installed into, which pip's default build
isolation hides. Putting torch in ``[build-system] requires`` would not help: pip would download a torch into the
isolated environment (gigabytes), possibly another version or CUDA variant than the one installed, and the extension
would then not match the torch it runs with. So, like flash-attn, torch-scatter and torchao's source builds,
paro-torch is built with ``pip install --no-build-isolation``; this backend makes ``pip install .`` without it fail
at once, before cargo starts, with that advice, instead of a compiler error minutes later.

What it adds to maturin's backend (every hook but the sdist's needs the installed torch):

* checks that torch is importable and within the range ``[project] dependencies`` supports;
* pins the wheel's ``Requires-Dist`` to the torch minor it was built against (``torch>=2.15,<2.16`` when built
  against 2.15): maturin takes dependencies from pyproject.toml only, so the pin is written into the metadata that
  maturin prepares and into the wheel it builds (METADATA and its RECORD line); the sdist keeps the supported range
  and declares ``Requires-Dist`` dynamic (core metadata 2.2);
* tags wheels ``manylinux_2_28``, as torch's own (``[tool.maturin] compatibility``; maturin's backend alone tags
  ``linux``), or, when built on a newer glibc, that glibc's manylinux tag: the linker binds the extension to the
  build machine's glibc symbol versions, so ``manylinux_2_28`` is only true of builds in the manylinux_2_28 image.
  libtorch is not vendored (``auditwheel = "skip"``): the extension uses the torch installed beside it.

PARO_TORCH_DIR (see rust/paro-ext/build.rs) names the torch to build against instead of the importable one.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import os
import re
import sys
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

try:
    import maturin
except ModuleNotFoundError:
    raise SystemExit(
        "paro-torch: maturin is missing. With --no-build-isolation pip installs no build requirements; "
        "install them first: pip install 'maturin>=1.9,<2'"
    ) from None

_NOT_FOUND = """paro-torch: torch is not importable in this build environment.

paro-torch compiles a C++ extension against the torch it will run with, so it builds in your environment, not in
pip's isolated build environment (which does not see your torch). Install torch first, then build without
isolation (maturin>=1.9 must be installed too):

    pip install --no-build-isolation paro-torch        # or, in a source checkout: pip install --no-build-isolation .
"""

_TORCH_REQ = re.compile(r"^torch\s*(?P<spec>[<>=!~][^;]*)$")
_RANGE = re.compile(r"^>=\s*(\d+)\.(\d+)\s*,\s*<\s*(\d+)\.(\d+)$")


def _pyproject() -> dict[str, Any]:
    with open("pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _torch_version() -> str:
    """The version of the torch the extension will be compiled against (the one build.rs probes)."""
    torch_dir = os.environ.get("PARO_TORCH_DIR")
    if torch_dir:
        text = (Path(torch_dir) / "version.py").read_text()
        found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
        if found is None:
            raise SystemExit(f"paro-torch: no __version__ in {torch_dir}/version.py (PARO_TORCH_DIR)")
        return found.group(1)
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(_NOT_FOUND) from None


def torch_pin() -> str:
    """``torch>=X.Y,<X.Y+1`` for the torch being built against; exits if it is outside the supported range."""
    version = _torch_version()
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", version).groups())
    supported = None
    for dep in _pyproject()["project"]["dependencies"]:
        found = _TORCH_REQ.match(dep.strip())
        if found:
            supported = _RANGE.match(found.group("spec").strip())
    if supported is None:
        raise SystemExit("paro-torch: pyproject.toml must require torch as 'torch>=A.B,<C.D'")
    lo, hi = (int(supported[1]), int(supported[2])), (int(supported[3]), int(supported[4]))
    if not lo <= (major, minor) < hi:
        raise SystemExit(
            f"paro-torch supports torch>={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; the torch to build against is {version}"
        )
    return f"torch>={major}.{minor},<{major}.{minor + 1}"


def _pinned(metadata: str, pin: str) -> str:
    """Core metadata with its unconditional torch requirement replaced by ``pin``."""
    lines = []
    for line in metadata.split("\n"):
        key, _, value = line.partition(": ")
        if key == "Requires-Dist" and _TORCH_REQ.match(value.strip()):
            line = f"Requires-Dist: {pin}"
        lines.append(line)
    return "\n".join(lines)


def _wheel_tag() -> str | None:
    """The manylinux tag for a wheel built here, or None off glibc (maturin's default then)."""
    wanted = _pyproject().get("tool", {}).get("maturin", {}).get("compatibility", "")
    want = re.fullmatch(r"manylinux_2_(\d+)", wanted)
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    here = re.fullmatch(r"glibc 2\.(\d+)", libc or "")
    if want is None or here is None:
        return None
    if int(here[1]) > int(want[1]):
        print(
            f"paro-torch: glibc 2.{here[1]} here: tagging the wheel manylinux_2_{here[1]}, not {wanted} "
            f"(build in the {wanted} image for that)",
            file=sys.stderr,
        )
    return f"manylinux_2_{max(int(want[1]), int(here[1]))}"


def _maturin_settings(config_settings: Mapping[str, Any] | None, wheel: bool) -> dict[str, Any]:
    args = maturin.get_maturin_pep517_args(config_settings)
    tag = _wheel_tag() if wheel else None
    if tag is not None and "--compatibility" not in args and "--manylinux" not in args:
        args = [*args, "--compatibility", tag]
    return {**(config_settings or {}), "maturin.build-args": args}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _pin_wheel(path: Path, pin: str) -> None:
    """Rewrites the wheel at ``path`` with the pinned METADATA (and its RECORD line)."""
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w") as dst:
        (meta,) = [n for n in src.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        record = meta.removesuffix("METADATA") + "RECORD"
        new_meta = _pinned(src.read(meta).decode(), pin).encode()
        for info in src.infolist():
            data = src.read(info)
            if info.filename == meta:
                data = new_meta
            elif info.filename == record:
                lines = [_record_line(meta, new_meta) if ln.startswith(meta + ",") else ln
                         for ln in data.decode().split("\n")]  # fmt: skip
                data = "\n".join(lines).encode()
            dst.writestr(info, data)
    os.replace(tmp, path)


def _dynamic_requires(path: Path) -> None:
    """Marks Requires-Dist dynamic in the sdist's PKG-INFO: a wheel built from it pins the torch it was built with."""
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(path) as src, tarfile.open(tmp, "w:gz", format=tarfile.PAX_FORMAT) as dst:
        for info in src.getmembers():
            f = src.extractfile(info) if info.isfile() else None
            if f is not None and re.fullmatch(r"[^/]+/PKG-INFO", info.name):
                text = f.read().decode()
                if "\nDynamic: Requires-Dist" not in text:
                    text = re.sub(r"^(Version: .*\n)", r"\1Dynamic: Requires-Dist\n", text, count=1, flags=re.M)
                data = text.encode()
                info.size = len(data)
                f = io.BytesIO(data)
            dst.addfile(info, f)
    os.replace(tmp, path)


def get_requires_for_build_wheel(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    """Checks the torch to build against, then asks maturin."""
    torch_pin()  # fails here, before any compiling, under build isolation
    return maturin.get_requires_for_build_wheel(config_settings)


def get_requires_for_build_editable(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    """As get_requires_for_build_wheel."""
    torch_pin()
    return maturin.get_requires_for_build_editable(config_settings)


def get_requires_for_build_sdist(config_settings: Mapping[str, Any] | None = None) -> list[str]:
    """Maturin's: an sdist needs no torch."""
    return maturin.get_requires_for_build_sdist(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    """Maturin's metadata, with the torch pin."""
    pin = torch_pin()
    name = maturin.prepare_metadata_for_build_wheel(metadata_directory, _maturin_settings(config_settings, False))
    meta = Path(metadata_directory) / name / "METADATA"
    meta.write_text(_pinned(meta.read_text(), pin))
    return name


prepare_metadata_for_build_editable = prepare_metadata_for_build_wheel


def build_wheel(
    wheel_directory: str, config_settings: Mapping[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    """Maturin's wheel, tagged (see the module docstring) and with the torch pin."""
    pin = torch_pin()
    name = maturin.build_wheel(wheel_directory, _maturin_settings(config_settings, True), metadata_directory)
    _pin_wheel(Path(wheel_directory) / name, pin)
    return name


def build_editable(
    wheel_directory: str, config_settings: Mapping[str, Any] | None = None, metadata_directory: str | None = None
) -> str:
    """Maturin's editable wheel, with the torch pin."""
    pin = torch_pin()
    name = maturin.build_editable(wheel_directory, _maturin_settings(config_settings, False), metadata_directory)
    _pin_wheel(Path(wheel_directory) / name, pin)
    return name


def build_sdist(sdist_directory: str, config_settings: Mapping[str, Any] | None = None) -> str:
    """Maturin's sdist, with Requires-Dist dynamic in PKG-INFO."""
    name = maturin.build_sdist(sdist_directory, config_settings)
    _dynamic_requires(Path(sdist_directory) / name)
    return name
