"""jaxinfer's native CPU kernels (C++ sources next to the modules that call them, run as XLA FFI custom
calls): built on first use, not at install, and registered with XLA.

``$CXX`` (or ``c++`` / ``g++``) compiles a source with ``-O3 -march=native`` into the user cache
(``kernels/``), the file named by a hash of the source, flags, compiler, CPU and jax version, written
under a temporary name and renamed (processes may race). Callers: ``quant.cpu_kernel`` (quantized
matmuls) and ``paged.cpu_attention`` (attention over the paged cache).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax

from jaxinfer.user_cache import user_cache_dir

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
HEADERS = (Path(__file__).with_name("native_pool.h"),)  # included by the sources: part of each build's key


def compiler() -> list[str]:
    """The C++ compiler's command (``$CXX``, which may carry a launcher or flags, else ``c++`` or
    ``g++`` on the PATH); a ``RuntimeError`` if there is none."""
    cxx = os.environ.get("CXX")
    cmd = shlex.split(cxx) if cxx else [shutil.which("c++") or shutil.which("g++") or ""]
    found = shutil.which(cmd[0]) if cmd and cmd[0] else None
    if not found:
        raise RuntimeError(
            f"jaxinfer's native CPU kernels (the quantized matmul, the attention) need a C++17 compiler to "
            f"build them once, and "
            f"{'$CXX=' + repr(cxx) + ' was not found' if cxx else 'none (c++, g++) is on the PATH'}: install one "
            f"(e.g. `apt-get install g++`) or set $CXX, or load the model in float "
            f"(quantization='none')")
    return [found, *cmd[1:]]


def available() -> bool:
    """Whether the kernels can be built here (a C++ compiler is found)."""
    try:
        compiler()
    except RuntimeError:
        return False
    return True


def _cpu() -> str:
    """What ``-march=native`` compiles for: a cache shared by several machines keeps one build each."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


_building: dict[str, concurrent.futures.Future] = {}  # by library path: builds under way in this process
_building_lock = threading.Lock()


def library_path(source: Path) -> str:
    """``source``'s shared library, compiled into the user cache unless already there (or waited for,
    if another thread of this process is compiling it)."""
    cxx = compiler()
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([source.read_text(), *(h.read_text() for h in HEADERS), *FLAGS,
                                    os.path.realpath(cxx[0]), *cxx[1:], version, _cpu(),
                                    jax.__version__]).encode()).hexdigest()[:16]
    path = os.path.join(user_cache_dir("kernels"), f"{source.stem}-{key}.so")
    if os.path.exists(path):
        return path
    with _building_lock:
        building = _building.get(path)
        if building is None:
            building = _building[path] = concurrent.futures.Future()
            owner = True
        else:
            owner = False
    if not owner:
        return building.result()
    try:
        _compile(cxx, path, source)
        building.set_result(path)
    except BaseException as e:
        building.set_exception(e)
        raise
    finally:
        with _building_lock:
            del _building[path]
    return path


def prebuild(*sources: Path) -> None:
    """Start compiling ``sources`` in the background (seconds each; a first start on CPU built them one
    after the other inside warm-up): the engine calls it before loading the weights, so the builds
    overlap the load and each other. A failure is left for the call that needs the library to report."""
    def build(source):
        try:
            library_path(source)
        except Exception:  # noqa: BLE001 - raised again, with its message, where the library is needed
            log.debug("background build of %s failed", source, exc_info=True)

    if available():
        for source in sources:
            threading.Thread(target=build, args=(source,), name=f"build-{source.stem}", daemon=True).start()


def _compile(cxx: list[str], path: str, source: Path) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log.info("building the CPU kernel %s (once): %s -> %s", source.name, " ".join(cxx), path)
    t0 = time.monotonic()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cmd = [*cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", f"-I{HEADERS[0].parent}", str(source), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CPU kernel {source.name} failed ({' '.join(cmd)}):\n{done.stderr}")
        os.replace(tmp, path)
        log.info("built the CPU kernel %s in %.1fs", source.name, time.monotonic() - t0)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_lock = threading.Lock()  # the engine traces its steps on several threads at once


@functools.cache
def _load(source: Path, targets: tuple[tuple[str, str], ...]) -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(library_path(source))
    for target, symbol in targets:
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


def register(source: Path, **targets: str) -> ctypes.CDLL:
    """Build ``source`` if needed and register its handlers with XLA (``target=symbol`` pairs); the
    loaded library."""
    with _lock:
        return _load(source, tuple(sorted(targets.items())))
