"""specdec.kernels: Triton kernels for tree attention over the paged KV cache.

Every kernel has a pure-PyTorch reference with identical semantics
(:mod:`specdec.attention` holds the attention reference the engine runs on CPU).
"""

if __name__ != "specdec.kernels":  # imported as a bare 'kernels' (repo root on sys.path): run nothing
    from specdec.layout_guard import stand_in

    stand_in(__name__)
