"""``python -m torchops bench``: the operators against PyTorch and their peers
(docs/benchmarks.md).  Inside the package, so that it runs from a wheel too;
nothing heavy is imported until a run needs it."""
