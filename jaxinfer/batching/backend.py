"""One object per platform, chosen once when an engine is built: the step's kernels (``Ops``) and
every default and behaviour that differs between platforms. Nothing else in ``batching/`` asks
which platform it runs on.

==============================  =====================  ==========================  =================
                                CPU                    GPU                         TPU
==============================  =====================  ==========================  =================
attention (``auto``)            ``cpu``: native        ``pallas_gpu``: Pallas      ``pallas_tpu``:
                                kernel for steps of    Triton decode + prefill,    Pallas Mosaic
                                <= 16 tokens, else     RoPE + K/V write fused      (interpret mode
                                the reference          (reference for head_dim     on CPU only)
                                                       96)
K/V write                       after the layer loop   inside the kernels          per layer
dtype (``auto``)                float32                bfloat16                    bfloat16
layer loop (``auto``)           indexed (scan on a     unrolled                    indexed (scan on
                                mesh)                                              a mesh)
buckets                         few, coarse            powers of two               powers of two
decode steps per dispatch       4                      1                           1
greedy or sampled               decided in the step    a compiled flag             a compiled flag
KV pool                         ``cpu_kv_cache_gib``   ``kv_cache_memory_fraction`` of device memory
n-gram ``ngram_min`` / overlap  2 / off                1 / on                      1 / on
==============================  =====================  ==========================  =================

Why each default is what it is: the attribute's comment says, with the figure that decided it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from jaxinfer.batching.buckets import Buckets, geometric
from jaxinfer.batching.config import ATTENTION_BACKENDS
from jaxinfer.models.layers import Ops
from jaxinfer.paged.attention import ragged_paged_attention as reference_attention


@dataclasses.dataclass(frozen=True)
class Backend:
    """The defaults of an accelerator; ``CpuBackend`` overrides them for XLA:CPU."""

    platform: str
    dtype: str = "bfloat16"
    # Decode steps one dispatch runs for a batch of decodes. 1: an accelerator's steps are dispatched
    # ahead of the device, which hides the host's work while a step outlasts its dispatch. Below that
    # (llama3-8b int4 at batch 1 on an H100, ~2.5 ms a step) 4 measured 1.11x; it stays opt-in until
    # the throughput and serving workloads are measured with it (a request arriving mid-run waits up
    # to that many steps for its prefill).
    scheduler_steps: int = 1
    # Whether a step's sampled tokens are copied to the host as soon as it is dispatched: on an H200 a
    # copy started only when the host asked for it took ~0.3-0.45 ms per array after the step ended.
    # On CPU the array is already in host memory and queuing the copy cost ~75 us of host time.
    copy_ahead: bool = True
    # Whether a step is compiled once for greedy and sampled rows alike (the choice made in the step)
    # rather than twice (a static flag): on CPU it halved warm-up's compilations at no cost per step.
    greedy_in_step: bool = False
    # The shortest n-gram worth proposing: a 1-token match's proposals pay where a verify step is
    # cheap (on an H200 batch 1, k = 4: 1.14 plain steps).
    ngram_min: int = 1
    # Whether an n-gram proposer keeps a verifying step in flight while the next is proposed: it hides
    # the host's work between steps (an H200 ran llama3-8b batch-1 speculation 4.01x plain decode
    # overlapped, 3.04x without).
    ngram_overlap: bool = True
    # Whether the KV pool is sized from device memory (``kv_cache_memory_fraction``) or from
    # ``cpu_kv_cache_gib`` (host memory has no allocator statistics to read).
    pool_from_device_memory: bool = True

    def layer_loop(self, sharded: bool, writes_after_layers: bool) -> str:
        """``layer_loop="auto"``: unrolled on GPU (measured faster) where the kernels write K/V inside
        the layers, scanned over a mesh, else indexed."""
        return "scan" if sharded else "indexed"

    def buckets(self, max_tokens: int, max_seqs: int, max_pages: int) -> Buckets:
        """Powers of two (tokens from 8, pages from 4): each compile is cheap next to the padding it saves."""
        return Buckets(geometric(min(8, max_tokens), max_tokens, 2), geometric(1, max_seqs, 2),
                       geometric(min(4, max_pages), max_pages, 2))

    def attention_backend(self, requested: str, head_dim: int) -> str:
        """The attention backend ``requested`` (``ATTENTION_BACKENDS``) names for a model of ``head_dim``."""
        if requested not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {requested!r}; allowed: {', '.join(ATTENTION_BACKENDS)}")
        return self._auto_attention(head_dim) if requested == "auto" else requested

    def _auto_attention(self, head_dim: int) -> str:
        return "reference"

    @staticmethod
    def writes_after_layers(attention: str, sharded: bool) -> bool:
        """Whether the step's layers only read the KV cache and every layer's K/V is written after
        the loop (``Ops.defer_kv_write``): the reference attention's way, one device only (per device
        the K/V would need their own shard_map specs, so a mesh writes per layer)."""
        return attention in ("reference", "cpu") and not sharded

    def ops(self, attention: str, head_dim: int, kv_quantized: bool) -> Ops:
        """The step's operations for the resolved ``attention`` backend (``attention_backend``)."""
        if kv_quantized and attention in ("pallas_tpu", "interpret"):
            # The TPU kernel's page DMAs and its (untested on hardware) tiling are for float pages only.
            raise ValueError(f"a quantized KV cache (kv_cache_dtype int8/fp8) is not supported by the {attention} "
                             f"attention backend; use attention_backend='reference' or kv_cache_dtype='auto'")
        if attention == "reference":
            return Ops(attention=reference_attention, defer_kv_write=True)
        if attention == "cpu":
            from jaxinfer.paged import cpu_attention
            return Ops(attention=cpu_attention.ragged_paged_attention, defer_kv_write=True)
        if attention == "pallas_gpu":
            from jaxinfer.pallas_kernels import gpu, rope_kv
            rope_kv.check_head_dim(head_dim)
            return Ops(attention=gpu.ragged_paged_attention, rope_write_kv=rope_kv.rope_write_kv,
                       decode_attention=gpu.rope_decode_attention, decode_attention_max_seqs=gpu.FUSED_MAX_SEQS)
        from jaxinfer.pallas_kernels import tpu
        interpret = attention == "interpret"
        return Ops(attention=functools.partial(tpu.ragged_paged_attention, interpret=True) if interpret
                   else tpu.ragged_paged_attention)

    def native_sources(self, attention: str, quantized: bool, sharded: bool) -> tuple:
        """The native CPU kernels (C++ sources) an engine will call, to build while weights load."""
        return ()

    def gguf_in_blocks(self) -> bool:
        """Whether a GGUF file can run in its own quantized blocks here (``quantization="auto"``)."""
        return True


@dataclasses.dataclass(frozen=True)
class GpuBackend(Backend):
    def layer_loop(self, sharded: bool, writes_after_layers: bool) -> str:
        return super().layer_loop(sharded, writes_after_layers) if writes_after_layers else "unroll"

    def _auto_attention(self, head_dim: int) -> str:
        from jaxinfer.pallas_kernels import rope_kv
        return "pallas_gpu" if head_dim in rope_kv.HEAD_DIMS else "reference"


@dataclasses.dataclass(frozen=True)
class TpuBackend(Backend):
    def _auto_attention(self, head_dim: int) -> str:
        return "pallas_tpu"


@dataclasses.dataclass(frozen=True)
class CpuBackend(Backend):
    dtype: str = "float32"
    # The host's work per dispatch (~1 ms on a 2-core box) took the cores from a SmolLM2 batch-1 step
    # of ~7.5 ms: 4 steps per dispatch took batch-1 decode from 0.88x to 1.06x llama.cpp's; more than
    # 4 saved little more and streams coarser.
    scheduler_steps: int = 4
    copy_ahead: bool = False
    greedy_in_step: bool = True
    # On XLA:CPU a batch-1 verify step costs ~2 plain ones whatever k, and a 1-token match's proposals
    # were accepted 0.7 tokens on average (2-token: 1.4) over input-grounded prompts, so they cost more
    # than they gained.
    ngram_min: int = 2
    # Little host work to hide next to 30+ ms steps, while a discarded step costs a whole verify step:
    # SmolLM2 with n-gram proposals ran 1.60x plain decode overlapped against 1.83x synchronously.
    ngram_overlap: bool = False
    pool_from_device_memory: bool = False

    def buckets(self, max_tokens: int, max_seqs: int, max_pages: int) -> Buckets:
        """A 1-token bucket for batch-1 decode, an 8-token one for decode batches of 2-8 sequences, then
        16 tokens and x4 steps; sequences 1, 4, 8, 16, x4...; one page bucket, the longest: the CPU's
        attention reads only as much context as the batch's longest sequence fills, so shorter page
        buckets saved nothing but compiled a step each. Measured on SmolLM2 (2-core box, under load):
        a step of 2 or 4 tokens cost about what 8 do (XLA:CPU's dots for 2-4 rows are slow) while 16
        tokens cost twice as much, so the 8-token bucket made 8 x (128 + 128) faster. The server's
        defaults plan 16 shapes."""
        tokens = {1, *(b for b in (8,) if b < max_tokens), *geometric(16, max_tokens, 4)} if max_tokens > 1 else {1}
        seqs = {*geometric(1, max_seqs, 4), *(b for b in (8,) if b < max_seqs)}
        return Buckets(tuple(sorted(tokens)), tuple(sorted(seqs)), (max_pages,))

    def _auto_attention(self, head_dim: int) -> str:
        return "cpu"

    def native_sources(self, attention: str, quantized: bool, sharded: bool) -> tuple:
        if sharded:
            return ()
        from jaxinfer.paged import cpu_attention
        from jaxinfer.quant import cpu_kernel
        return (*([cpu_attention.SOURCE] if attention == "cpu" else []), *([cpu_kernel.SOURCE] if quantized else []))

    def gguf_in_blocks(self) -> bool:
        """Through the native kernel (``quant.cpu_kernel``), which needs a C++ compiler: the embedded
        SmolLM2's batch-1 step 2.1x faster than its float32 weights, same float32 arithmetic; without
        one, float32 (XLA alone decodes the blocks into a float copy every step, 2.5-4x slower)."""
        from jaxinfer.quant import cpu_kernel
        return cpu_kernel.available()


def backend_for(platform: str | None = None) -> Backend:
    """The backend of ``platform`` (``jax.default_backend()`` by default)."""
    platform = platform or jax.default_backend()
    cls = {"cpu": CpuBackend, "gpu": GpuBackend, "tpu": TpuBackend}.get(platform, Backend)
    return cls(platform)
