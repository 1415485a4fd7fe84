"""torchops: dispatcher-native custom operators for PyTorch.

Every op is registered with PyTorch's dispatcher (CPU, CUDA and Autograd
kernels plus a fake), so it works in eager mode, under autograd, in
``torch.compile(fullgraph=True)`` and in ``torch.export``.  Call them as
``torchops.<op>(...)`` or ``torch.ops.torchops.<op>(...)``.

Importing torchops loads the native libraries (building them once, into a
cache, if no matching prebuilt library is installed).  It never initialises
CUDA.
"""

import sys as _sys

from torchops._build import VERSION as __version__
from torchops import _loader

try:
    _loader.load()
except _loader.LoadError as _e:
    # `python -m torchops doctor` must be able to report a failed load, and
    # Python imports this package before running torchops/__main__.py; while
    # it does, sys.argv[0] is "-m" (documented in the `python -m` reference).
    if not (_sys.argv and _sys.argv[0] == "-m"):
        raise
    load_error = _e
else:
    load_error = None
    from torchops import ops
    from torchops.ops import *  # noqa: F401,F403  (every public op)

    __all__ = [*ops.__all__, "__version__"]
