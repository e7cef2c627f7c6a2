"""Sections of ``benchmarks/gpu_validate.py`` (one module each; ``common`` holds the shared
context, the model, the time budget and the task plumbing). Imported as
``benchmarks.gpuval``: the script puts the repository root on ``sys.path``."""
