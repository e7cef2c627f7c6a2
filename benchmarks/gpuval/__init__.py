"""Sections of ``benchmarks/gpu_validate.py`` (one module each; ``common`` holds the shared
context, the model, the time budget and the task plumbing). Imported as the top-level
package ``gpuval``: running the script puts ``benchmarks/`` first on ``sys.path``."""
