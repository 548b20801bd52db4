"""Loops whose loads Triton stages through shared memory, for Pallas' Triton kernels.

A streaming kernel (a decode matvec reads each weight byte once) keeps the memory busy only with
enough bytes in flight: at roughly a microsecond of load latency, 4.4 TB/s needs ~4 MB in flight,
~33 KB per SM of an H200. A load into registers holds them until its data lands, so a kernel's
registers bound its bytes in flight (qmatvec's register prefetch: 2 tiles per program, 4 programs
per SM at 127 registers a thread; its int8 matvecs took the same time on an H100 as on an H200,
whose memory is 1.44x faster). Triton's software pipeliner instead issues a loop's loads ``stages -
1`` iterations ahead as asynchronous copies into shared memory (``cp.async``), which hold no
registers while in flight. It pipelines the loads that feed a ``dot``, and every load of a loop that
carries the ``tt.num_stages`` attribute (what ``tl.range(..., num_stages=n)`` sets in Triton's own
language). Pallas' Triton lowering (jax 0.10-0.11) sets no such attribute and has no option for it.

So ``staged(name, stages)`` returns a kernel name for ``pallas_call(name=...)``; once Pallas has
lowered a kernel of that name to Triton IR, every ``scf.for`` in it gets ``tt.num_stages =
stages``. This wraps a private JAX function (``lower_jaxpr_to_triton_module``, which
``pallas_call_registration`` calls); where a JAX release lacks it, kernels run unstaged (correct,
slower) and a warning says so.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

_SUFFIX = "_staged"


def staged(name: str, stages: int) -> str:
    """``name`` marked so that its kernel's loops are software-pipelined ``stages`` deep."""
    if stages < 2:
        return name
    _install()
    return f"{name}{_SUFFIX}{stages}"


def _tag_loops(module, stages: int) -> None:
    from jax._src.lib.mlir import ir

    with module.context:
        attr = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), stages)

        def visit(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if inner.operation.name == "scf.for":
                            inner.operation.attributes["tt.num_stages"] = attr
                        visit(inner.operation)

        visit(module.operation)


@functools.cache
def _install() -> None:
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
        lower = registration.lowering.lower_jaxpr_to_triton_module
    except (ImportError, AttributeError) as e:
        log.warning("Pallas' Triton lowering has changed (%s): quantized matvecs run without staged loads", e)
        return

    @functools.wraps(lower)
    def lower_and_tag(jaxpr, *args, **kwargs):
        result = lower(jaxpr, *args, **kwargs)
        name = jaxpr.debug_info.func_name if jaxpr.debug_info is not None else ""
        head, sep, stages = name.rpartition(_SUFFIX)
        if sep and stages.isdigit():
            _tag_loops(result.module, int(stages))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = lower_and_tag
