"""The benchmarks, one folder per thing measured; each script runs from the repository root as
``python benchmarks/<group>/<name>.py``. A package so that shared helpers import by one name
(``benchmarks.stack.common``) from scripts, from each other and from tests."""
