"""What a benchmark run ran on: devices, versions, date, command."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

import torchops

__all__ = ["environment"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """The checkout's commit; TORCHOPS_COMMIT names it where there is no .git
    (a copied working tree)."""
    if os.environ.get("TORCHOPS_COMMIT"):
        return os.environ["TORCHOPS_COMMIT"]
    root = Path(torchops.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "csrc",
                                "torchops"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + (" (modified)" if dirty.stdout.strip() else "")


def environment(devices: list[str], command: str, all_threads: int) -> dict:
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchvision": _version("torchvision"),
        "torchops": torchops.__version__,
        "torchops_commit": _git_commit(),
        "python": platform.python_version(),
        "cpu": f"{_cpu_name()} ({all_threads} threads used as 'all')",
    }
    if "cuda" in devices and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu"] = (f"{props.name} ({props.total_memory / 2**30:.0f} GiB, "
                      f"{props.multi_processor_count} SMs, sm_{props.major}{props.minor})")
    return env
