"""Pallas kernels for the step's attention, behind the operations of ``jaxinfer.models.layers.Ops``
(which kernels a platform uses: ``jaxinfer.batching.backend``). Every kernel takes every option the
decoder passes (soft cap, a static or traced sliding window, Q/K/V biases, q/k head norms), so a
family never loses a kernel for having them.

- ``gpu.py`` (Pallas Triton): flash-decoding split-KV decode and causal prefill over the paged cache
  (``ragged_paged_attention``), and the decode kernel with RoPE and the K/V write fused in
  (``rope_decode_attention``, decode-only steps of up to ``FUSED_MAX_SEQS`` sequences).
- ``rope_kv.py``: RoPE + the K/V cache write in one kernel (``rope_write_kv``), replacing about five
  small XLA kernels per layer on GPUs.
- ``tpu.py`` (Pallas Mosaic TPU; checked only in interpret mode on CPU).
- ``qmatvec.py``: the quantized weights' matvec for decode on GPUs, which ``jaxinfer.quant.qlinear``
  calls by itself for a few tokens.

A quantized KV cache (int8/fp8 codes plus per-token scales, ``paged.kv_cache``) is read by the GPU
kernels (which dequantize after each page load, so only the codes cross memory); the TPU kernel
refuses it.
"""
