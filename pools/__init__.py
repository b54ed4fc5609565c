"""DeepSeek-V4 token-to-KV pools: what moves, and whether two sides agree on it.

Everything here except :mod:`kvbeam.pools.allocate` is torch-free, so the control
plane can build and compare layouts without paying for ``import torch``.
"""
