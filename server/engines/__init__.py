"""The daemon's side of its local engine: the attach socket, the engine's memory checked
and mapped (host memory or dma-buf), and the per-request engine channel."""
