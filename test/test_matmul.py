"""matmul-specific CPU tests (the generic ones come from its opdb entry): both
vector widths of the packed GEMM, on shapes that end mid-tile in every
dimension, against the float64 reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Runs in a subprocess: the kernel reads TORCHOPS_TESTING_MATMUL_NARROW, and a
# fresh process makes sure the forced path is the one that ran.
_CHECK = r"""
import torch, torchops
from torchops import references
torch.manual_seed(0)
shapes = [(None, 1, 1, 1), (None, 7, 1, 5), (None, 1, 300, 1), (None, 97, 300, 33),
          (None, 6, 256, 32), (None, 5, 257, 31), (None, 13, 700, 17), (3, 19, 23, 29)]
for threads in (1, 2):
    torch.set_num_threads(threads)
    for batch, m, k, n in shapes:
        pre = () if batch is None else (batch,)
        for dt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12),
                        (torch.bfloat16, 1e-2), (torch.float16, 1e-3)):
            a = torch.randn(*pre, m, k, dtype=torch.float64).to(dt)
            b = torch.randn(*pre, n, k, dtype=torch.float64).to(dt).transpose(-1, -2)
            got = torchops.matmul(a, b).double()
            want = references.matmul(a.double(), b.double())
            err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-9)).item()
            assert err < tol, (threads, batch, m, k, n, dt, err)
print("CHECKED")
"""


@pytest.mark.parametrize("narrow", ["0", "1"])
def test_cpu_gemm_paths_match_reference(narrow):
    """narrow=1 forces the 32-byte (AVX2/SSE) kernels even on an AVX-512 CPU;
    narrow=0 takes the widest the CPU has."""
    env = dict(os.environ, TORCHOPS_TESTING_MATMUL_NARROW=narrow)
    proc = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "CHECKED" in proc.stdout, proc.stdout + proc.stderr
