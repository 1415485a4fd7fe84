"""Benchmarks of the torchops operators (``python -m torchops bench``).

The registry of what is measured lives in :mod:`torchops.bench.cases`, inside
the package rather than in a repository folder, so that the command works the
same from a checkout, an editable install and an installed wheel.  Importing
this package imports nothing heavy; torchvision and matplotlib are imported
only when a run needs them.
"""
