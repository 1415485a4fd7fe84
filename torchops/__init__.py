"""torchops: dispatcher-native custom operators for PyTorch.

Every op is registered with PyTorch's dispatcher (CPU, CUDA and Autograd
kernels plus a fake), so it works in eager mode, under autograd, in
``torch.compile(fullgraph=True)`` and in ``torch.export``.  Call them as
``torchops.<op>(...)`` or ``torch.ops.torchops.<op>(...)``.

Importing torchops loads the native libraries (building them once, into a
cache, if no matching prebuilt library is installed).  It never initialises
CUDA.
"""

import os as _os
import sys as _sys


def _running_the_cli() -> bool:
    # `doctor` and `build` must run when loading fails -- that is when they are
    # needed -- and the package is imported before either starts: by
    # `python -m torchops`, with sys.argv[0] == "-m" meanwhile (documented in
    # the `python -m` reference), and by the `torchops` console script, whose
    # wrapper imports torchops.cli with sys.argv[0] the script's own path.
    if not _sys.argv:
        return False
    name = _os.path.basename(_sys.argv[0])
    for suffix in ("-script.pyw", "-script.py", ".exe"):  # Windows launchers
        name = name.removesuffix(suffix)
    return _sys.argv[0] == "-m" or name == "torchops"


if _running_the_cli():
    # Without numpy installed (it is optional for torch and for torchops),
    # `import torch` warns "Failed to initialize NumPy" in every process.
    # The command-line tools do not need numpy: that one warning is noise in
    # their output.  Library users keep every warning.
    import warnings as _warnings

    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from torchops._build import VERSION as __version__  # noqa: E402
from torchops import _loader  # noqa: E402

try:
    _loader.load()
except _loader.LoadError as _e:
    if not _running_the_cli():
        raise
    load_error = _e
else:
    load_error = None
    from torchops import modules, ops, sharding  # noqa: F401  (sharding: DTensor rules)
    from torchops.modules import *  # noqa: F401,F403  (nn.Module wrappers)
    from torchops.ops import *  # noqa: F401,F403  (every public op)

    __all__ = [*ops.__all__, *modules.__all__, "__version__"]
    # optim: torch.nn.utils.clip_grad_norm_ on multi_tensor_l2norm/_scale_
    from torchops.clip_grad import clip_grad_norm_  # noqa: E402

    __all__ += ["clip_grad_norm_"]
