"""Packaging: the stubs against the extension; the wheel and the sdist, each installed into a virtual environment
that has only torch, where ``paro plan`` and a 4-rank training step run; the build backend's refusals.

The slow tests build the wheel once from this checkout (in place: with CI's cargo target directory warm from
scripts/setup.sh's editable build, cargo finds everything fresh and maturin re-packs) and the sdist once, then build
a wheel from the unpacked sdist, which is what ``pip install paro-torch-X.tar.gz`` does, with this Python (torch and
maturin are here; another interpreter would rebuild pyo3) and the same target directory, where cargo reuses what is
fresh for the sdist's files too (see ``built``; PARO_SDIST_FROM_SCRATCH=1 compiles it all again, about a minute on
2 idle cores). The environments are ``venv --without-pip`` ones whose only other packages are torch
and its requirements, linked (see ``_linked_site``), not copied; pip installs the wheel alone into them from here
(``pip --python``), then ``pip check`` says whether that torch meets the wheel's pinned requirement.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
BACKEND = ROOT / "build_backend"

# --- the stubs ---------------------------------------------------------------------------------------------------


def _stub() -> ast.Module:
    return ast.parse((ROOT / "paro_torch" / "_C.pyi").read_text())


def _stub_params(fn: ast.FunctionDef, method: bool) -> list[tuple[str, str]]:
    """(name, default as source, or "" for none) of a stub function's parameters, self left out for methods."""
    args = fn.args
    plain = [*args.posonlyargs, *args.args][1 if method else 0 :]
    defaults = [""] * (len(plain) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    kw = [
        (a.arg, ast.unparse(d) if d is not None else "") for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
    ]
    return [(a.arg, d) for a, d in zip(plain, defaults, strict=True)] + kw


def _runtime_params(obj: object) -> list[tuple[str, str]] | None:
    """The same from the extension's text signature; None where it has none. pyo3 writes defaults it cannot render
    (``1 << 20``, ``-1``) as ``...``: those are kept as ``...`` and match any stub default."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    out = []
    for p in sig.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = "" if p.default is p.empty else "..." if p.default is Ellipsis else repr(p.default)
        out.append((p.name, default))
    return out


def _agree(where: str, stub: list[tuple[str, str]], runtime: list[tuple[str, str]] | None) -> list[str]:
    if runtime is None:
        return []
    if [n for n, _ in stub] != [n for n, _ in runtime]:
        return [f"{where}: stub parameters {[n for n, _ in stub]}, extension {[n for n, _ in runtime]}"]
    return [
        f"{where}({name}): stub default {s or 'none'}, extension {r or 'none'}"
        for (name, s), (_, r) in zip(stub, runtime, strict=True)
        if r != "..." and s != r and not (s and r and _same_value(s, r))
    ]


def _same_value(a: str, b: str) -> bool:
    try:
        return ast.literal_eval(a) == ast.literal_eval(b)
    except ValueError:
        return False


def test_stubs_match_the_extension() -> None:
    """Every name the extension exports has a stub and every stub a name; functions, constructors and methods have
    the extension's parameters and defaults; properties, static methods and exception bases agree."""
    from paro_torch import _C

    stub = {node.name if not isinstance(node, ast.AnnAssign) else node.target.id: node for node in _stub().body
            if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AnnAssign)}  # fmt: skip
    exported = set(_C.__all__)
    problems = [f"{name}: exported by the extension, no stub" for name in sorted(exported - stub.keys())]
    problems += [f"{name}: stub, not in the extension" for name in sorted(stub.keys() - set(dir(_C)))]
    for name, node in sorted(stub.items()):
        obj = getattr(_C, name, None)
        if obj is None:
            continue
        if isinstance(node, ast.FunctionDef):
            problems += _agree(name, _stub_params(node, False), _runtime_params(obj))
        elif isinstance(node, ast.AnnAssign):
            want = {"str": str, "list": list, "tuple": tuple}.get(ast.unparse(node.annotation).split("[")[0])
            if want is not None and not isinstance(obj, want):
                problems.append(f"{name}: stub {ast.unparse(node.annotation)}, extension {type(obj).__name__}")
        elif issubclass(obj, BaseException):
            bases = [ast.unparse(b) for b in node.bases]
            if bases != [b.__name__ for b in obj.__bases__]:
                problems.append(f"{name}: stub bases {bases}, extension {[b.__name__ for b in obj.__bases__]}")
        else:
            problems += _class_problems(name, node, obj)
    assert not problems, "paro_torch/_C.pyi disagrees with the extension:\n" + "\n".join(problems)


def _class_problems(name: str, node: ast.ClassDef, cls: type) -> list[str]:
    members = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    public = {n for n in vars(cls) if not n.startswith("_")}
    problems = [f"{name}.{n}: in the extension, no stub" for n in sorted(public - members.keys())]
    problems += [f"{name}.{n}: stub, not in the extension" for n in sorted(members.keys() - public - {"__init__"})]
    if "__init__" in members:
        problems += _agree(name, _stub_params(members["__init__"], True), _runtime_params(cls))
    for n, fn in members.items():
        if n == "__init__" or n not in public:
            continue
        decorators = {ast.unparse(d) for d in fn.decorator_list}
        raw = vars(cls)[n]
        if type(raw).__name__ == "getset_descriptor":
            if "property" not in decorators:
                problems.append(f"{name}.{n}: a property in the extension, not in the stub")
            continue
        static = isinstance(raw, staticmethod)
        if static != ("staticmethod" in decorators):
            problems.append(f"{name}.{n}: staticmethod in {'the extension' if static else 'the stub'} only")
        problems += _agree(f"{name}.{n}", _stub_params(fn, not static), _runtime_params(getattr(cls, n)))
    return problems


def test_the_version_has_one_source() -> None:
    """paro_torch.__version__ is the Cargo workspace's version, and pyproject.toml takes it from there."""
    import paro_torch

    tomllib = pytest.importorskip("tomllib")

    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in project and "version" in project["dynamic"], project
    assert paro_torch.__version__ == cargo


def test_another_torch_minor_is_refused_on_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension carries the torch it was built against; another minor is an ImportError naming both and how
    to rebuild."""
    from paro_torch import _C, _torch_check

    assert _C.TORCH_VERSION == torch.__version__
    _torch_check.check()  # the same torch: nothing to say
    major, minor = torch.__version__.split(".")[:2]
    monkeypatch.setattr(torch, "__version__", f"{major}.{int(minor) - 1}.0")
    with pytest.raises(ImportError) as err:
        _torch_check.check()
    said = str(err.value)
    assert f"built against torch {_C.TORCH_VERSION}" in said and f"torch {major}.{int(minor) - 1}.0 is" in said, said
    assert "pip install --no-build-isolation" in said, said


# --- the build backend's refusals -------------------------------------------------------------------------------


def _linked_site(roots: list[str], dest: Path) -> Path:
    """A directory of symlinks to the installed files of ``roots`` and everything they require (markers evaluated
    here, extras followed): an environment's worth of those packages, for a ``.pth`` file to add."""
    dest.mkdir(parents=True)
    todo, seen = [(r, frozenset[str]()) for r in roots], set()
    while todo:
        name, extras = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = (dist.metadata["Name"].lower().replace("_", "-"), extras)
        if key in seen:
            continue
        seen.add(key)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((req.name, frozenset(req.extras)))
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            link = dest / top
            if not link.exists():
                link.symlink_to(Path(dist.locate_file(top)).resolve())
    return dest


def _venv(path: Path, site: Path) -> Path:
    """A virtual environment without pip whose only packages are those linked in ``site``; returns its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (purelib,) = path.glob("lib/python*/site-packages")
    (purelib / "_linked.pth").write_text(f"{site}\n")
    return path / "bin" / "python"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX"))}
    return {**env, **extra}


_HOOK = "import sys; sys.path.insert(0, 'build_backend'); import paro_build; "  # as a build frontend calls it


def test_building_without_torch_stops_at_once(tmp_path: Path) -> None:
    """Where torch cannot be imported (pip's build isolation), the backend's first hook exits with the advice to
    use --no-build-isolation, before cargo starts."""
    pytest.importorskip("maturin")
    python = _venv(tmp_path / "venv", _linked_site(["maturin"], tmp_path / "site"))
    hook = _HOOK + "paro_build.get_requires_for_build_wheel()"
    t0 = time.monotonic()
    done = subprocess.run([python, "-c", hook], cwd=ROOT, capture_output=True, text=True, env=_clean_env())
    assert done.returncode != 0 and time.monotonic() - t0 < 30, done
    assert "torch is not importable" in done.stderr and "pip install --no-build-isolation" in done.stderr, done.stderr


# --- the wheel and the sdist, installed ---------------------------------------------------------------------------

STEP = '''
"""4 ranks on the paro backend, 2 groups of 2: one ParoShardedModule step equals one process's step."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

if not hasattr(dist.Backend, "_ensure_backend_registered"):  # torch < 2.14 loads no backend entry points
    import paro_torch  # noqa: F401
dist.init_process_group("paro")  # from the installed entry point
import paro_torch
from paro_torch import ParoShardedModule

assert paro_torch.__file__.startswith(sys.prefix), paro_torch.__file__
rank, world = dist.get_rank(), dist.get_world_size()


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Linear(8, 4))


g = torch.Generator().manual_seed(1)
x, y = torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 4, generator=g)
ref = make()
nn.functional.mse_loss(ref(x), y).backward()
torch.optim.SGD(ref.parameters(), lr=0.1).step()
model = ParoShardedModule(make(), "IIG", group_size=2, wrap_policy={nn.Linear})
opt = torch.optim.SGD(model.parameters(), lr=0.1)
mine = slice(4 * rank, 4 * rank + 4)
nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
opt.step()
got, want = model.full_state_dict(), ref.state_dict()
worst = max((got[k] - want[k]).abs().max().item() for k in want)
assert worst < 1e-5, worst
if rank == 0:
    print(f"STEP OK {paro_torch.__version__} on torch {torch.__version__}, max |diff| {worst:.1e}", flush=True)
dist.destroy_process_group()
'''


def _target_dir() -> Path:
    return Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")


def _build_wheel(source: Path, out: Path, target: Path | None = None) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index", "-w", out, source]
    # maturin's backend runs the maturin installed beside this Python (as scripts/setup.sh's build does)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = _clean_env(CARGO_TARGET_DIR=str(target or _target_dir()), PATH=path)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    (wheel,) = out.glob("paro_torch-*.whl")
    return wheel


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheel built from this checkout, the sdist, and the wheel built from the unpacked sdist."""
    pytest.importorskip("maturin")
    tmp = tmp_path_factory.mktemp("packaging")
    t0 = time.monotonic()
    hook = _HOOK + "print(paro_build.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", hook, tmp], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sdist = tmp / done.stdout.split()[-1]
    wheel = _build_wheel(ROOT, tmp / "wheel")
    t1 = time.monotonic()
    # Cargo identifies the sdist's crates with the checkout's (their paths relative to the workspace agree): with the
    # same target directory it reuses what it compiled for the checkout wherever the sdist's copy of every file it
    # tracks (the Rust sources; the C++ ones, through build.rs) is there and not newer; a missing one is a rebuild,
    # which then fails. PARO_SDIST_FROM_SCRATCH=1 builds the sdist in a target directory of its own instead.
    scratch = os.environ.get("PARO_SDIST_FROM_SCRATCH") == "1"
    src = tmp / "sdist-src" if scratch else _target_dir() / "sdist-check"
    shutil.rmtree(src, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(src, filter="data")
    (unpacked,) = src.iterdir()
    from_sdist = _build_wheel(unpacked, tmp / "from-sdist", tmp / "sdist-target" if scratch else None)
    print(f"built the sdist and the wheel in {t1 - t0:.0f} s, a wheel from the sdist in {time.monotonic() - t1:.0f} s")
    site = _linked_site(["torch"], tmp / "torch-site")
    return {"tmp": tmp, "sdist": sdist, "wheel": wheel, "from_sdist": from_sdist, "torch_site": site}


def _metadata(wheel: Path) -> tuple[str, str]:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return z.read(meta).decode(), "\n".join(names)


def _check_wheel(wheel: Path) -> None:
    metadata, names = _metadata(wheel)
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    torch_reqs = [ln for ln in metadata.splitlines() if re.match(r"Requires-Dist: torch\b", ln)]
    assert torch_reqs == [f"Requires-Dist: torch>={major}.{minor},<{major}.{minor + 1}"], torch_reqs
    assert "License-Expression: Apache-2.0" in metadata and "dist-info/licenses/LICENSE" in names, names
    assert re.search(r"-cp\d+-cp\d+-manylinux_2_\d+_x86_64\.whl$", wheel.name), wheel.name
    libc = int(os.confstr("CS_GNU_LIBC_VERSION").split(".")[1])
    assert f"manylinux_2_{max(28, libc)}_" in wheel.name, wheel.name
    assert len(re.findall(r"paro_torch/_C\..*\.so", names)) == 1, names


def _install_and_run(wheel: Path, venv: Path, site: Path) -> None:
    """Installs ``wheel`` into a new torch-only environment; runs ``paro plan``, the 4-rank step, and an import
    under a pretended other torch minor."""
    t = [time.monotonic()]
    python = _venv(venv, site)
    # --no-deps: pip must not touch the linked packages; `pip check` then says whether the linked torch meets the pin
    pip = [sys.executable, "-m", "pip", "--python", python]
    env = {k: v for k, v in _clean_env().items() if not k.startswith("PIP_")}
    done = subprocess.run([*pip, "install", "--no-index", "--no-deps", wheel], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([*pip, "check"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    t.append(time.monotonic())
    run = venv / "run"  # not the checkout: its paro_torch must not be the one imported
    run.mkdir()
    env = _clean_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    plan = subprocess.run([venv / "bin" / "paro", "plan", "--model", "llama-7b", "--nodes", "2", "--group-size", "8"],
                          cwd=run, capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert plan.returncode == 0 and "IIG" in plan.stdout, plan.stdout[-2000:] + plan.stderr[-2000:]
    t.append(time.monotonic())
    (run / "step.py").write_text(STEP)
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "step.py"]
    step = subprocess.run(cmd, cwd=run, capture_output=True, text=True, env=env, timeout=300)
    assert step.returncode == 0 and "STEP OK" in step.stdout, step.stdout[-3000:] + step.stderr[-6000:]
    t.append(time.monotonic())
    pretend = "import torch; torch.__version__ = '2.0.0'; import paro_torch"
    refused = subprocess.run([python, "-c", pretend], cwd=run, capture_output=True, text=True, env=env)
    assert refused.returncode != 0, refused
    assert f"built against torch {torch.__version__}, but torch 2.0.0 is installed" in refused.stderr, refused.stderr
    assert "pip install --no-build-isolation" in refused.stderr, refused.stderr
    t.append(time.monotonic())
    phases = ("environment and install", "paro plan", "4-rank step", "refused import")
    print(f"{wheel.name}: " + ", ".join(f"{p} {b - a:.0f} s" for p, a, b in zip(phases, t[:-1], t[1:], strict=True)))


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(1800)
def test_the_wheel_installs_and_trains(built: dict[str, Path]) -> None:
    """The wheel built from this checkout: its metadata (torch pinned to this minor, license, platform tag) and, in a
    torch-only environment, ``paro plan`` and a 4-rank ParoShardedModule step on the paro backend."""
    _check_wheel(built["wheel"])
    _install_and_run(built["wheel"], built["tmp"] / "venv-wheel", built["torch_site"])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.timeout(1800)
def test_the_sdist_builds_installs_and_trains(built: dict[str, Path]) -> None:
    """The sdist carries what the build needs (it built a wheel on its own), its license and Requires-Dist marked
    dynamic; the wheel built from it works in a torch-only environment as the checkout's does."""
    with tarfile.open(built["sdist"]) as tar:
        names = tar.getnames()
        (pkg_info,) = [n for n in names if n.count("/") == 1 and n.endswith("/PKG-INFO")]
        metadata = tar.extractfile(pkg_info).read().decode()
    top = pkg_info.split("/")[0]
    needed = ["pyproject.toml", "Cargo.toml", "Cargo.lock", "LICENSE", "build_backend/paro_build.py"]
    needed += ["rust/paro-ext/build.rs", "rust/paro-ext/cpp/paro_backend.cc", "paro_torch/__init__.py"]
    versioned = subprocess.run(["git", "ls-files", "rust", "paro_torch", "build_backend"], cwd=ROOT,
                               capture_output=True, text=True)  # fmt: skip
    if versioned.returncode == 0:  # every versioned source of the build (not a git checkout: the list above only)
        needed += versioned.stdout.split()
    missing = [n for n in needed if f"{top}/{n}" not in names]
    assert not missing, (missing, names)
    assert not [n for n in names if n.endswith(".so")], names
    (supported,) = re.findall(r'^dependencies = \["(torch[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert "Dynamic: Requires-Dist" in metadata and f"Requires-Dist: {supported}" in metadata, metadata
    _check_wheel(built["from_sdist"])
    _install_and_run(built["from_sdist"], built["tmp"] / "venv-sdist", built["torch_site"])
