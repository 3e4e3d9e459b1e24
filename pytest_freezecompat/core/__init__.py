"""Plain data every layer shares (stdlib only): cell keys and ids, typed records, pipe messages, names.

Everything may import `core`; `core` imports nothing of this package outside itself, and no torch.
"""
