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
    full = os.environ.get("TORCHOPS_TEST_PROFILE", "ci") == "full"
    if full and settings is not None and not config.getoption("hypothesis_profile", None):
        settings.load_profile("full")


def pytest_report_header(config):
    return f"torchops test profile: {os.environ.get('TORCHOPS_TEST_PROFILE', 'ci')}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
