import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import opdb`


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
