"""specdec.kernels: Triton kernels for tree attention over the paged KV cache.

Every kernel has a pure-PyTorch reference with identical semantics
(:mod:`specdec.attention` holds the attention reference the engine runs on CPU).
"""
