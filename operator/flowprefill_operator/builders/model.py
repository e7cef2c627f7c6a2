"""Pure: a pool's model source -> the volumes, mounts and download step of its pods, and
the directory its process loads.

- ``hf://``: a ``fetch-model`` init container (the pod's own image, online, ``HF_TOKEN``
  from the pool's Secret) downloads into the model cache (emptyDir, a per-pod ephemeral
  claim or a shared claim); the serving container mounts the cache read-only and runs
  offline.
- ``pvc://``: the claim, read-only, at :data:`PVC_MOUNT` (``subPath`` for the sub-path).
- ``image``: an image volume, read-only, at ``image.mountPath``.
- ``path`` alone: nothing to mount (a directory inside the image, or a built-in).

The gateway gets the tokenizer alone (:func:`tokenizer_parts`): a tokenizer-only download
into its own emptyDir whenever the tokenizer comes from the Hub, never the weights' cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowprefill.contracts.deployment import HF_TOKEN_SOURCE_ENV, OFFLINE_ENV
from flowprefill.contracts.model_uri import (
    MODEL_CACHE_MOUNT,
    PVC_MOUNT,
    TOKEN_ENV,
    TOKENIZER_DIR,
    ClaimSource,
    HubSource,
    hub_local_dir,
)
from flowprefill.contracts.processes import Launcher, fetch_model_argv

from ..models.modelsource import ModelSource
from ..settings import OperatorSettings
from .common import container_security_context

MODEL_VOLUME = "model"
CACHE_VOLUME = "model-cache"
TOKENIZER_VOLUME = "tokenizer"
FETCH_CONTAINER = "fetch-model"
FETCH_TOKENIZER_CONTAINER = "fetch-tokenizer"
DOWNLOAD_CONTAINERS = (FETCH_CONTAINER, FETCH_TOKENIZER_CONTAINER)
"""Init containers whose failure the pool's status reports (their termination message)."""
TOKENIZER_SIZE_LIMIT = "1Gi"

DOWNLOAD_ENV = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"},
    {"name": "HF_HOME", "value": "/tmp/.cache/huggingface"},
    {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
    # The one container that must be online: explicit, whatever the image's environment
    # says (the serving containers get OFFLINE_ENV).
    *({"name": name, "value": "0"} for name in OFFLINE_ENV),
    # hf-xet keeps a chunk cache (10 GB by default) under HF_HOME, on the pod's /tmp
    # emptyDir: the files land in the model cache already, so keep none.
    {"name": "HF_XET_CHUNK_CACHE_SIZE_BYTES", "value": "0"},
]


@dataclass(frozen=True)
class ModelParts:
    """What a pod needs for its model: the directory its process loads, volumes, the
    serving container's mounts and the init containers that fill them."""

    path: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    init_containers: list[dict[str, Any]] = field(default_factory=list)


def model_dir(model: ModelSource) -> str:
    """The directory the engine or vLLM loads (a built-in's name for a built-in)."""
    source = model.source
    if isinstance(source, HubSource):
        return hub_local_dir(source)
    if isinstance(source, ClaimSource):
        return PVC_MOUNT
    assert model.path is not None  # the model's rules: uri or path
    return model.path


def tokenizer_dir(model: ModelSource) -> str:
    """The directory the gateway reads its tokenizer from."""
    source = model.tokenizer_source
    if isinstance(source, HubSource):
        return TOKENIZER_DIR
    if isinstance(source, ClaimSource):
        return PVC_MOUNT
    return model_dir(model)


def _claim_volume(source: ClaimSource) -> tuple[dict[str, Any], dict[str, Any]]:
    volume = {
        "name": MODEL_VOLUME,
        "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
    }
    mount: dict[str, Any] = {"name": MODEL_VOLUME, "mountPath": PVC_MOUNT, "readOnly": True}
    if source.sub_path:
        mount["subPath"] = source.sub_path
    return volume, mount


def _cache_volume(model: ModelSource, labels: dict[str, str]) -> dict[str, Any]:
    cache = model.cache
    if cache is not None and cache.claim_name:
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.claim_name}}
    if cache is not None and cache.ephemeral:
        claim: dict[str, Any] = {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": cache.ephemeral.size}},
        }
        if cache.ephemeral.storage_class_name:
            claim["storageClassName"] = cache.ephemeral.storage_class_name
        return {
            "name": CACHE_VOLUME,
            "ephemeral": {"volumeClaimTemplate": {"metadata": {"labels": labels}, "spec": claim}},
        }
    empty: dict[str, Any] = {}
    if cache is not None and cache.size_limit:
        empty["sizeLimit"] = cache.size_limit
    return {"name": CACHE_VOLUME, "emptyDir": empty}


def _download_step(
    name: str,
    image: str,
    source: HubSource,
    dest: str,
    volume: dict[str, str],
    model: ModelSource,
    settings: OperatorSettings,
    *,
    tokenizer_only: bool,
) -> dict[str, Any]:
    env: list[dict[str, Any]] = list(DOWNLOAD_ENV)
    if settings.hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": settings.hf_endpoint})
    ref = model.token_secret_ref
    if ref is not None:
        env += [
            {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}},
            {"name": HF_TOKEN_SOURCE_ENV, "value": f"Secret {ref.name} key {ref.key}"},
        ]
    command = fetch_model_argv(Launcher.image(), source.uri, dest, tokenizer_only=tokenizer_only)
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": command,
        "env": env,
        "volumeMounts": [volume, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": container_security_context(),
        # The step writes its one-line reason to the termination log; the kubelet copies it
        # (or, failing that, the log's tail) into the pod status for the operator to read.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def model_parts(
    model: ModelSource, image: str, settings: OperatorSettings, labels: dict[str, str]
) -> ModelParts:
    """The model's volumes, mounts and download step for a prefill or decode pod running
    ``image`` (the download step runs the same image: it has the ``flowprefill`` CLI)."""
    source = model.source
    if isinstance(source, HubSource):
        dest = hub_local_dir(source)
        cache = {"name": CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT}
        step = _download_step(FETCH_CONTAINER, image, source, dest, cache, model, settings,
                              tokenizer_only=False)  # fmt: skip
        return ModelParts(
            path=dest,
            volumes=[_cache_volume(model, labels)],
            mounts=[{"name": CACHE_VOLUME, "mountPath": MODEL_CACHE_MOUNT, "readOnly": True}],
            init_containers=[step],
        )
    if isinstance(source, ClaimSource):
        volume, mount = _claim_volume(source)
        return ModelParts(path=PVC_MOUNT, volumes=[volume], mounts=[mount])
    if model.image is not None:
        volume = {
            "name": MODEL_VOLUME,
            "image": {"reference": model.image.reference, "pullPolicy": model.image.pull_policy},
        }
        mount = {"name": MODEL_VOLUME, "mountPath": model.image.mount_path, "readOnly": True}
        return ModelParts(path=model_dir(model), volumes=[volume], mounts=[mount])
    return ModelParts(path=model_dir(model))  # inside the image, or a built-in


def tokenizer_parts(model: ModelSource, image: str, settings: OperatorSettings) -> ModelParts:
    """What the gateway (running ``image``) needs for the tokenizer: a tokenizer-only
    download into its own emptyDir when it comes from the Hub; else the model's claim or
    image, read-only (a claim must then allow a second reader: ReadOnlyMany or
    ReadWriteMany, or set ``tokenizerUri``)."""
    source = model.tokenizer_source
    if isinstance(source, HubSource):
        mount = {"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR}
        step = _download_step(FETCH_TOKENIZER_CONTAINER, image, source, TOKENIZER_DIR, mount,
                              model, settings, tokenizer_only=True)  # fmt: skip
        return ModelParts(
            path=TOKENIZER_DIR,
            volumes=[{"name": TOKENIZER_VOLUME, "emptyDir": {"sizeLimit": TOKENIZER_SIZE_LIMIT}}],
            mounts=[{"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR, "readOnly": True}],
            init_containers=[step],
        )
    if isinstance(source, ClaimSource):
        volume, mount = _claim_volume(source)
        return ModelParts(path=PVC_MOUNT, volumes=[volume], mounts=[mount])
    return model_parts(model, image, settings, {})
