"""specdec.kernels: the Triton kernels of the GPU path and the dispatch that chooses them.

Tree attention over the paged KV cache (``tree_attention``), the KV write and the accepted path's compaction
(``kv_write``), fused add+RMSNorm / RoPE / SiLU-mul (``fused_ops``), CUDA-graph metadata (``graph_metadata``),
and ``dispatch``, which picks kernels or the PyTorch references once per runner / cache. Every kernel has a
pure-PyTorch reference with identical semantics (:mod:`specdec.attention` holds the attention reference the
engine runs on CPU).
"""

if __name__ != "specdec.kernels":  # imported as a bare 'kernels' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)
