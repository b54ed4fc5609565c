"""A DeepSeek-V4-shaped reference engine whose continuation proves moved state is right.

The engine's layers keep their KV rows, compressed entries and compression states in
exactly kvbeam's buffers, at indices its own shuffled allocator chooses. Prefill on
one engine, move the state, continue on another: the tokens must equal those of one
engine that ran prompt and continuation itself. See docs/refengine.md.
"""

from kvbeam.refengine.copy import copy_state
from kvbeam.refengine.engine import Continuation, Engine, PrefillResult
from kvbeam.refengine.memory import SideMemory, fill_garbage
from kvbeam.refengine.model import ModelShape, ReferenceModel

__all__ = ["Continuation", "Engine", "ModelShape", "PrefillResult", "ReferenceModel",
           "SideMemory", "copy_state", "fill_garbage"]
