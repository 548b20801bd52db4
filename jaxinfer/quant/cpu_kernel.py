"""The CPU matmul of quantized weights: a native kernel (``cpu_qmatmul.cc``) called as an XLA custom call.

Why a custom call: XLA:CPU's dot calls a library GEMM on materialized float operands, so a
``QArray`` through XLA is decoded into a float copy of the whole weight every step and then
multiplied, moving more bytes than the float32 weight would (GGUF Q4_1 measured 2.5-4x slower than
float32 per step, docs/benchmarks.md), and no blocked ``dot_general`` over int8 codes did better.
The kernel decodes each block of codes in registers and multiply-adds it in float32 against the
float32 activations, so it reads only the codes and equals dequantize-then-matmul within float32
rounding. It splits the output rows over XLA's own intra-op thread pool (the FFI's ``ThreadPool``),
so the ops around it keep that pool's threads awake.

Built on first use, not at install: ``$CXX`` (or ``c++`` / ``g++``) compiles it with
``-O3 -march=native`` into the user cache (``kernels/``), the file named by a hash of the source,
flags, compiler, CPU and jax version, written under a temporary name and renamed (processes may race).

Formats: ``q4_0``, ``q4_1``, ``q8_0``, ``int4`` (any group size a multiple of 32) and ``int8`` (one
scale per row), 2-D weights whose input dimension is a multiple of 32.
"""

from __future__ import annotations

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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.quant.qarray import QArray
from jaxinfer.user_cache import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_qmatmul.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
FORMAT_IDS = {"q4_0": 0, "q4_1": 1, "q8_0": 2, "int4": 3, "int8": 4}  # as the kernel's Format
TARGET = "jaxinfer_cpu_qmatmul"
# Workers per call: 0 = the caller plus XLA's intra-op pool (its size); n > 0 = the caller plus n - 1
# pool tasks (1: the caller alone). For benchmarks.
THREADS = 0


def supported(w) -> bool:
    """Whether the kernel takes ``w``: a 2-D ``QArray`` of its formats, input a multiple of 32, float16
    or float32 scales and offsets."""
    if not isinstance(w, QArray) or w.scheme not in FORMAT_IDS or w.values.ndim != 2:
        return False
    if any(a is not None and a.dtype not in (jnp.float16, jnp.float32) for a in (w.scales, w.offsets)):
        return False
    n = w.shape[-1]
    if w.scheme == "int8":
        return n % 32 == 0 and w.group_size == n
    return n % 32 == 0 and w.group_size % 32 == 0 and n % w.group_size == 0


def available() -> bool:
    """Whether the kernel can be built here (a C++ compiler is found): what ``quantization="auto"``
    asks before running a GGUF file in its own blocks on CPU."""
    try:
        compiler()
    except RuntimeError:
        return False
    return True


def compiler() -> list[str]:
    """The C++ compiler's command (``$CXX``, which may carry a launcher or flags, else ``c++`` or
    ``g++`` on the PATH); a ``RuntimeError`` if there is none."""
    cxx = os.environ.get("CXX")
    cmd = shlex.split(cxx) if cxx else [shutil.which("c++") or shutil.which("g++") or ""]
    found = shutil.which(cmd[0]) if cmd and cmd[0] else None
    if not found:
        raise RuntimeError(
            f"quantized weights on CPU need a C++17 compiler to build jaxinfer's matmul kernel once, and "
            f"{'$CXX=' + repr(cxx) + ' was not found' if cxx else 'none (c++, g++) is on the PATH'}: install one "
            f"(e.g. `apt-get install g++`) or set $CXX, or load the model in float "
            f"(quantization='none')")
    return [found, *cmd[1:]]


def _cpu() -> str:
    """What ``-march=native`` compiles for: a cache shared by several machines keeps one build each."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def library_path() -> str:
    """The kernel's shared library, compiled into the user cache unless already there."""
    cxx = compiler()
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, os.path.realpath(cxx[0]), *cxx[1:], version,
                                    _cpu(), jax.__version__]).encode()).hexdigest()[:16]
    path = os.path.join(user_cache_dir("kernels"), f"cpu_qmatmul-{key}.so")
    if not os.path.exists(path):
        _compile(cxx, path)
    return path


def _compile(cxx: list[str], path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log.info("building the CPU quantized-matmul kernel (once): %s -> %s", " ".join(cxx), path)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cmd = [*cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CPU quantized-matmul kernel failed ({' '.join(cmd)}):\n{done.stderr}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_lock = threading.Lock()  # the engine traces its steps on several threads at once


@functools.cache
def _library() -> ctypes.CDLL:
    lib = ctypes.cdll.LoadLibrary(library_path())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxinferQMatmul), platform="cpu")
    return lib


def _register() -> None:
    with _lock:
        _library()


def qmatmul(x: jax.Array, w: QArray) -> jax.Array:
    """``x [T, in]`` (float32; ``col_scale`` already applied) times ``dequantize(w) [out, in]``
    transposed, as float32 ``[T, out]``, through the kernel."""
    _register()
    offsets = w.offsets if w.offsets is not None else jnp.zeros((0,), jnp.float16)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[-2]), jnp.float32))
    return call(x.astype(jnp.float32), w.values, w.scales, offsets, fmt=np.int64(FORMAT_IDS[w.scheme]),
                group=np.int64(w.group_size), threads=np.int64(THREADS))
