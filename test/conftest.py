"""Test options, markers and hypothesis profiles.

    pytest test                      CPU CI: small samples, hypothesis profile "ci"
    pytest test --full               larger samples (opdb's sample_inputs_large),
                                     hypothesis profile "full"
                                     (also: TORCHOPS_TEST_PROFILE=full)
    pytest test -m cuda              only the GPU-side tests
    pytest test --hypothesis-profile=full   only the long property runs' setting
    pytest test/test_fuzz.py --fuzz-count=500 --fuzz-seed=1   a longer fuzzing sweep

See docs/testing.md.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import opdb`


def _load_envs():
    # torchops/envs.py by path, as _build.py loads it: importing torchops here
    # would load (or build) the libraries before any test asks for them.
    import importlib.util

    module = sys.modules.get("torchops_envs")
    if module is None:
        path = os.path.join(os.path.dirname(__file__), os.pardir, "torchops", "envs.py")
        spec = importlib.util.spec_from_file_location("torchops_envs", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return module


envs = _load_envs()

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the property tests importorskip it
    settings = None
else:
    _common = dict(deadline=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    # CI: few examples, derandomized so that a CI run is reproducible.
    settings.register_profile("ci", max_examples=12, derandomize=True, **_common)
    settings.register_profile("full", max_examples=300, **_common)
    settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="torchops: the long profile (larger samples, more hypothesis examples); "
                          "same as TORCHOPS_TEST_PROFILE=full")
    parser.addoption("--fuzz-count", type=int, default=24,
                     help="torchops: calls per op family and device in test_fuzz.py's sweep")
    parser.addoption("--fuzz-seed", type=int, default=0,
                     help="torchops: the base seed of test_fuzz.py's sweep")


def pytest_configure(config):
    if config.getoption("--full"):
        os.environ["TORCHOPS_TEST_PROFILE"] = "full"
    full = envs.get("TORCHOPS_TEST_PROFILE") == "full"
    if full and settings is not None and not config.getoption("hypothesis_profile", None):
        settings.load_profile("full")


def pytest_report_header(config):
    return f"torchops test profile: {envs.get('TORCHOPS_TEST_PROFILE')}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _masked_conv2d_exact_float32(request):
    """masked_conv2d follows PyTorch's convolution precision rule: TF32 on
    CUDA by default, as conv2d.  Its tests compare float32 with a float64
    reference at float32 tolerances, so they run with TF32 off for
    convolutions; the tests of the rule itself set it.  Other ops' tests
    keep PyTorch's default."""
    if "masked_conv2d" not in request.node.nodeid:
        yield
        return
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32 = old
