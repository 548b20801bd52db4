"""bench_qmatvec probe: main's default blocks; K split x2 (more programs: wave tails); 16 rows;
load-only (same loads, one FFMA per code word); L2 codes (every program reads the first row block:
the decode and FMAs at L2 speed); contiguous tiles (each tile's codes one run of bytes; values wrong, timing
only); 8 warps. Run with PYTHONPATH=<probe tree>."""
import sys
sys.path.insert(0, "scripts")
import bench_qmatvec as b
from jaxinfer.pallas_kernels.qmatvec import default_blocks


def configs(out, n_in, bits, extra):
    d = dict(default_blocks(out, n_in, bits), num_warps=4, num_stages=3)
    return [d, dict(d, split_k=d["split_k"] * 2), dict(d, block_rows=16, split_k=max(1, d["split_k"])),
            dict(d, mode="loadonly"), dict(d, mode="l2codes"), dict(d, mode="contig"),
            dict(d, num_warps=8)][:extra + 1]


b.configs = configs
b.main()
