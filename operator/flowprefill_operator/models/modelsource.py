"""``spec.model``: where a pool's weights come from, its served name, the download cache."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from flowprefill.contracts.model_uri import (
    HF_SCHEME,
    MODEL_URI_PATTERN,
    TOKEN_ENV,
    ClaimSource,
    HubSource,
    ModelURI,
    parse_model_uri,
)

from .common import QUANTITY, CRModel, cel

MOUNT_PATH = r"^(/[^/]+)+$"
"""An absolute path, not ``/`` (an image over the root filesystem), without a trailing
slash (the prefix rule compares it plus ``/``)."""

PATH_UNDER_IMAGE = (
    "has(self.path) && (self.path == self.image.mountPath"
    " || self.path.startsWith(self.image.mountPath + '/'))"
)

URI_OR_PATH = "set exactly one of uri (hf:// or pvc://) and path"
IMAGE_NEEDS_PATH = "with image, path must be image.mountPath or a directory under it"
IMAGE_AND_URI = "set at most one of uri and image"
TOKEN_NEEDS_HUB = "tokenSecretRef applies to hf:// sources (uri or tokenizerUri)"
CACHE_NEEDS_HUB = "cache applies to uri hf:// (the download's destination)"


class SecretKeyRef(CRModel):
    """A key of a Secret in the pool's namespace."""

    name: str = Field(max_length=253, description="Secret name.")
    key: str = Field(default=TOKEN_ENV, max_length=253, description="Key within the Secret.")


class EphemeralCache(CRModel):
    """A claim per pod, created with the pod and deleted with it (a generic ephemeral
    volume): block storage every managed cluster provisions (EBS, PD, Azure Disk)."""

    size: str = Field(pattern=QUANTITY, max_length=64, description="Storage request, e.g. 40Gi.")
    storage_class_name: str | None = Field(
        default=None, max_length=253, description="StorageClass; unset = the cluster's default."
    )


class ModelCache(CRModel):
    """Where ``hf://`` downloads land. Unset fields: the pod's own emptyDir (node disk,
    downloaded again by every new pod)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.claimName) && has(self.ephemeral))",
                    "set at most one of claimName and ephemeral",
                ),
                cel(
                    "!has(self.sizeLimit) || !(has(self.claimName) || has(self.ephemeral))",
                    "sizeLimit applies to the emptyDir cache (neither claimName nor ephemeral)",
                ),
            ]
        }
    )

    claim_name: str | None = Field(
        default=None,
        max_length=253,
        description="An existing writable PVC shared by every pod of the pool (ReadWriteMany "
        "to span nodes): each revision is downloaded once.",
    )
    ephemeral: EphemeralCache | None = Field(
        default=None, description="A claim per pod (generic ephemeral volume)."
    )
    size_limit: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=64,
        description="sizeLimit of the emptyDir cache (the kubelet evicts a pod past it).",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> ModelCache:
        if self.claim_name is not None and self.ephemeral is not None:
            raise ValueError("set at most one of claimName and ephemeral")
        if self.size_limit is not None and (self.claim_name or self.ephemeral):
            raise ValueError(
                "sizeLimit applies to the emptyDir cache (neither claimName nor ephemeral)"
            )
        return self


class ImageSource(CRModel):
    """An OCI image holding the model, mounted read-only as an image volume (the
    ImageVolume feature: on by default from Kubernetes 1.35)."""

    reference: str = Field(max_length=512, description="Image reference, pinned by digest ideally.")
    mount_path: str = Field(
        default="/models",
        pattern=MOUNT_PATH,
        max_length=256,
        description="Where the image is mounted (absolute, no trailing slash).",
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy of the model image."
    )


class ModelSource(CRModel):
    """Where the weights come from: ``uri`` (``hf://`` downloaded into the cache before
    the engine starts, ``pvc://`` mounted read-only), an image volume plus ``path``, or
    ``path`` alone (a directory inside the engine image, or a built-in such as
    ``tiny-llama``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.uri) != has(self.path)", URI_OR_PATH),
                cel("!(has(self.uri) && has(self.image))", IMAGE_AND_URI),
                cel(f"!has(self.image) || ({PATH_UNDER_IMAGE})", IMAGE_NEEDS_PATH),
                cel(
                    "!has(self.tokenSecretRef)"
                    f" || (has(self.uri) && self.uri.startsWith('{HF_SCHEME}'))"
                    f" || (has(self.tokenizerUri) && self.tokenizerUri.startsWith('{HF_SCHEME}'))",
                    TOKEN_NEEDS_HUB,
                ),
                cel(
                    f"!has(self.cache) || (has(self.uri) && self.uri.startsWith('{HF_SCHEME}'))",
                    CACHE_NEEDS_HUB,
                ),
            ]
        }
    )

    uri: str | None = Field(
        default=None,
        pattern=MODEL_URI_PATTERN,
        max_length=512,
        description="hf://org/name[@revision] (a Hub repository, downloaded into the cache "
        "before the engine starts) or pvc://claim[/sub/path] (mounted read-only).",
    )
    path: str | None = Field(
        default=None,
        pattern=r"^(/.*|[a-z0-9][-a-z0-9.]*)$",
        max_length=1024,
        description="Without uri: the model directory inside the container (under "
        "image.mountPath with image), or an engine built-in (tiny-llama).",
    )
    name: str | None = Field(
        default=None,
        max_length=253,
        description="Served model name (the request's `model`); defaults to the service name.",
    )
    image: ImageSource | None = Field(
        default=None, description="Mount the model from an OCI image (an image volume)."
    )
    token_secret_ref: SecretKeyRef | None = Field(
        default=None,
        description="Hub token (gated or private repositories): a Secret key, sent only by "
        "the download steps, never to the engine or vLLM.",
    )
    cache: ModelCache | None = Field(
        default=None, description="Where hf:// downloads land; unset = the pod's emptyDir."
    )
    tokenizer_uri: str | None = Field(
        default=None,
        pattern=MODEL_URI_PATTERN,
        max_length=512,
        description="Where the gateway reads the tokenizer (hf:// downloads the tokenizer "
        "files alone); unset = uri when it is hf://, else the model's own source mounted "
        "read-only (a pvc:// claim must then be ReadOnlyMany or ReadWriteMany).",
    )

    @model_validator(mode="after")
    def _mirror_cel(self) -> ModelSource:
        # The CRD's rules, for objects admitted without them (an old CRD, the emulator).
        if (self.uri is None) == (self.path is None):
            raise ValueError(URI_OR_PATH)
        if self.uri is not None and self.image is not None:
            raise ValueError(IMAGE_AND_URI)
        if self.image is not None:
            mount = self.image.mount_path
            if self.path is None or not (self.path == mount or self.path.startswith(mount + "/")):
                raise ValueError(IMAGE_NEEDS_PATH)
        hub = [u for u in (self.uri, self.tokenizer_uri) if u and u.startswith(HF_SCHEME)]
        if self.token_secret_ref is not None and not hub:
            raise ValueError(TOKEN_NEEDS_HUB)
        if self.cache is not None and not (self.uri and self.uri.startswith(HF_SCHEME)):
            raise ValueError(CACHE_NEEDS_HUB)
        return self

    @property
    def source(self) -> ModelURI | None:
        """The parsed ``uri`` (None for an image or a path)."""
        return parse_model_uri(self.uri) if self.uri else None

    @property
    def hub(self) -> HubSource | None:
        source = self.source
        return source if isinstance(source, HubSource) else None

    @property
    def claim(self) -> ClaimSource | None:
        source = self.source
        return source if isinstance(source, ClaimSource) else None

    @property
    def tokenizer_source(self) -> ModelURI | None:
        """Where the gateway's tokenizer comes from when it is not the model's own mount."""
        if self.tokenizer_uri:
            return parse_model_uri(self.tokenizer_uri)
        return self.hub
