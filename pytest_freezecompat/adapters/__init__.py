"""One package per framework: `__init__.py` declares what it offers (no framework import), `adapter.py`
implements `base.Adapter`, and `emulation.py` (if any) is its CUDA-on-CPU shim. Shared mechanics live
here once: the contract (`base`), the training loop (`loop`), views of wrapped models (`views`), shims
(`emulation`)."""
