"""wagma's benchmarks: ``run.py`` (policies x imbalance scenarios on CPU ranks) and ``gpu.py`` (CUDA kernels).

``python benchmarks/run.py --help`` for the policy benchmark; see ``benchmarks/README.md``.
"""
