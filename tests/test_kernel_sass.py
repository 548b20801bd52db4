"""``benchmarks/kernel_sass.py`` without a GPU or the ``triton`` package: the Pallas calls it takes from
lowering a kernel for CUDA, and what it reads from SASS. (Compiling to SASS needs ``triton``, which
the tests do not install.)"""

import argparse

from helpers import benchmark_module

kernel_sass = benchmark_module("kernel_sass")


def test_takes_each_pallas_call_as_lowered_for_cuda():
    args = argparse.Namespace(kv="fp8", seqs=4, ctx=128, block_k=64, warps=8, stages=2, prefill_warps=None)
    fn, inputs = kernel_sass.decode_attention(args)
    modules = kernel_sass.triton_modules(fn, *inputs)
    by_name = {m["name"]: m for m in modules}
    decode = by_name["paged_decode_gpu"]
    assert (decode["warps"], decode["stages"]) == (8, 2)  # the call's own launch parameters
    assert "cvt.rn.f16x2.e4m3x2" in decode["ttir"]  # the fp8 cache's words, converted two codes at a time
    # 4 sequences split their keys to fill the GPU, so the partials' combine kernel is lowered too;
    # each module is paired with its own call's parameters
    assert set(by_name) == {"paged_decode_gpu", "paged_decode_combine_gpu"}
    assert all(m["ttir"].startswith(f"module @{m['name']} ") for m in modules)


SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/              @!P0 LDS.U8 R2, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R16, R8, R12, R16 ;
        /*0040*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0050*/               @P1 BRA 0x10 ;
        /*0060*/                   BRA 0x70 ;
        /*0070*/                   EXIT ;
"""


def test_loop_is_a_branch_back_with_its_opcodes():
    stats = kernel_sass.loop_stats(SASS)
    assert stats["instructions"] == 8
    assert stats["loops"] == [dict(instructions=5, opcodes={"HMMA": 2, "LDS": 1, "IADD3": 1, "BRA": 1})]
