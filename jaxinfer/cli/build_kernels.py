"""Build the native CPU kernels now (the C++ attention and quantized-matmul kernels the CPU backend
calls through XLA's FFI), so the first ``jaxinfer serve`` on this machine does not spend its first
seconds compiling them; ``make serve`` runs it after installing. Without it they are built on first
use, logged, and kept in ``$XDG_CACHE_HOME/jaxinfer/kernels``.

    jaxinfer build-kernels
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys

from jaxinfer.cli.options import Parser


def main(argv: list[str]) -> None:
    Parser("jaxinfer build-kernels", __doc__).parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxinfer import native
    from jaxinfer.paged import cpu_attention
    from jaxinfer.quant import cpu_kernel

    if not native.available():
        sys.exit("jaxinfer build-kernels: no C++ compiler found (set CXX); the CPU backend then runs without "
                 "its native kernels")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one compiler process each
        for path in pool.map(native.library_path, (cpu_attention.SOURCE, cpu_kernel.SOURCE)):
            print(path)
