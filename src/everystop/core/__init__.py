"""Pure-Python scheduling core: requests, KV block bookkeeping, the iteration scheduler.

NOTE: nothing under core/ may import torch (a test enforces it), so the scheduler can be built,
tested and simulated with no model, no device and no disk.
"""
