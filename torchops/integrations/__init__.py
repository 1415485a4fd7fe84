"""Putting torchops kernels into other libraries' models (``transformers``)."""
