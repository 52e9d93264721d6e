"""Where tritonserver and its Python backend are, and which allocator they run on."""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import sysconfig
from dataclasses import dataclass

from tritone.cache import cache_root

# The directory that holds the tritone package: on the stub's module path, so that the models
# import the same code as the launcher (a checkout's backends/, or site-packages).
PACKAGE_PARENT = pathlib.Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class TritonInstall:
    binary: pathlib.Path
    backend_dir: pathlib.Path
    env: dict[str, str]


def find_tritonserver() -> TritonInstall:
    """NVIDIA's container install if present, else the binary in the nvidia-pytriton wheel."""
    env = dict(os.environ)
    python_path = list(dict.fromkeys([str(PACKAGE_PARENT), sysconfig.get_paths()["purelib"],
                                      sysconfig.get_paths()["platlib"]]))
    container = pathlib.Path("/opt/tritonserver")
    if (container / "bin" / "tritonserver").exists():
        return TritonInstall(container / "bin" / "tritonserver", container / "backends", env)
    try:
        import pytriton
    except ImportError:
        raise RuntimeError("no tritonserver found: use NVIDIA's tritonserver container, or "
                           "pip install nvidia-pytriton (scripts/serve does this)") from None
    wheel = pathlib.Path(pytriton.__file__).parent / "tritonserver"
    libs = pathlib.Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = wheel / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    # One backend directory per checkout and environment: servers started from two checkouts
    # at once would otherwise hand each other's stubs the wrong paths.
    key = hashlib.sha256(repr(python_path).encode()).hexdigest()[:12]
    backend_dir = cache_root() / "triton_backends" / key
    python_backend = backend_dir / "python"
    python_backend.mkdir(parents=True, exist_ok=True)
    for item in (wheel / "backends" / "python").iterdir():
        if item.is_file():
            _link(item, python_backend / item.name)
    _link(stub, python_backend / "triton_python_backend_stub")
    # The stub runs Python isolated (environment variables ignored) from the base interpreter's
    # sys.path, with the backend directory on it: a module there hands it our paths.
    (python_backend / "tritone_env.py").write_text(
        f"import sys\nsys.path[:0] = [p for p in {python_path!r} if p not in sys.path]\n")
    libpython_dir = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(libs), libpython_dir, env.get("LD_LIBRARY_PATH", "")) if p)
    return TritonInstall(wheel / "bin" / "tritonserver", backend_dir, env)


# tritonserver spends about a fifth of its CPU in the C library's malloc and free under streaming
# load (three messages per streamed token, each allocated, copied and freed across threads); any
# of these allocators takes 10% to 20% off the text path's CPU per token
# (docs/performance.md). mimalloc comes with Tritone's dependencies; the others where the system
# has them (NVIDIA's container ships jemalloc and tcmalloc).
MALLOC_LIBRARIES = {"mimalloc": ("mimalloc",), "jemalloc": ("jemalloc",), "tcmalloc": ("tcmalloc_minimal", "tcmalloc")}


def find_malloc(choice: str) -> str | None:
    """The allocator library to preload for `--malloc choice` (None: the C library's)."""
    if choice == "system":
        return None
    if choice not in ("auto", *MALLOC_LIBRARIES):
        if not pathlib.Path(choice).is_file():
            raise ValueError(f"--malloc {choice}: no such file (auto, system, {', '.join(MALLOC_LIBRARIES)} "
                             "or a library's path)")
        return choice
    for name in MALLOC_LIBRARIES if choice == "auto" else (choice,):
        found = _malloc_library(name)
        if found:
            return found
    if choice != "auto":
        raise ValueError(f"--malloc {choice}: the library is not installed")
    return None


def _malloc_library(name: str) -> str | None:
    import ctypes.util

    if name == "mimalloc":  # the cmeel-mimalloc wheel, in this environment
        for site in dict.fromkeys((sysconfig.get_paths()["platlib"], sysconfig.get_paths()["purelib"])):
            found = sorted(pathlib.Path(site, "cmeel.prefix", "lib").glob("libmimalloc.so.*"))
            if found:
                return str(found[0])
    for soname in MALLOC_LIBRARIES[name]:
        found = ctypes.util.find_library(soname)
        if found:
            return found
    return None


def _link(source: pathlib.Path, target: pathlib.Path) -> None:
    if target.is_symlink() or target.exists():
        if target.resolve() == source.resolve():
            return
        target.unlink()
    target.symlink_to(source)


