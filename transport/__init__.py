"""Data plane: moves bytes between (address, length, key) regions.

This package never imports torch: daemons that only route control messages, and
tests running under TCG (where ``import torch`` costs about a minute), must not
pay for it.
"""
