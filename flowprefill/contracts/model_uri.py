"""Model sources as URIs, spelled as llm-d's ``modelArtifacts.uri`` and KServe's
``storageUri`` spell them, and where each lands inside a pod.

- ``hf://org/name[@revision]``: a Hugging Face Hub repository (``HF_ENDPOINT`` may point at
  a mirror), downloaded once into the pod's model cache by the ``fetch-model`` init step.
- ``pvc://claim[/sub/path]``: a PersistentVolumeClaim in the pool's namespace, mounted
  read-only at :data:`PVC_MOUNT` (the sub-path through ``subPath``).

The operator's CRD admits exactly the strings :func:`parse_model_uri` parses (the two
patterns below are the CRD's), and the fetch step and the builders agree on the local
directory through :func:`hub_local_dir`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

HF_SCHEME: Final = "hf://"
PVC_SCHEME: Final = "pvc://"

HF_REPO_PART = r"[A-Za-z0-9][-A-Za-z0-9_.]{0,95}"
PLAIN_SEGMENT = r"[-A-Za-z0-9_.]*[-A-Za-z0-9_][-A-Za-z0-9_.]*"
"""A path segment that is not ``.`` or ``..`` (RE2, as CEL and the API server use: no
look-ahead)."""
HF_URI_PATTERN: Final = (
    rf"^hf://{HF_REPO_PART}(/{HF_REPO_PART})?(@{PLAIN_SEGMENT}(/{PLAIN_SEGMENT}){{0,8}})?$"
)
"""``hf://`` + a Hub repo id (``name`` or ``org/name``) + an optional ``@revision``: a
branch, tag or commit (``refs/pr/1`` included; no ``.``/``..`` segment, which git refuses
too and which would lead the download out of its cache directory)."""
PVC_URI_PATTERN: Final = rf"^pvc://[a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?(/{PLAIN_SEGMENT})*/?$"
"""``pvc://`` + a claim name (DNS subdomain) + an optional sub-path of plain segments (no
``.`` or ``..``: the kubelet refuses a subPath that leaves the volume)."""
MODEL_URI_PATTERN: Final = f"({HF_URI_PATTERN})|({PVC_URI_PATTERN})"

MODEL_CACHE_MOUNT: Final = "/var/cache/flowprefill/models"
"""Where a pod's model cache is mounted (an emptyDir, a per-pod ephemeral claim or a
shared claim); ``hf://`` downloads land under it, one directory per repo and revision."""
PVC_MOUNT: Final = "/models"
"""Where a ``pvc://`` source is mounted (read-only); the model directory itself."""
TOKENIZER_DIR: Final = "/var/cache/flowprefill/tokenizer"
"""The gateway's tokenizer files (its own emptyDir: the gateway never mounts weights)."""
DEFAULT_REVISION: Final = "main"
TOKEN_ENV: Final = "HF_TOKEN"
"""The Hub token variable huggingface_hub reads; filled from the pool's token Secret."""

TOKENIZER_FILES: Final = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""What the gateway reads from a model directory (tokenizer, chat template, config): the
allow-list of its tokenizer-only download. Weights are never among them."""


class ModelURIError(ValueError):
    """A model URI that is neither ``hf://`` nor ``pvc://`` as :data:`MODEL_URI_PATTERN`
    admits; the message names the URI and the accepted forms."""


@dataclass(frozen=True)
class HubSource:
    """``hf://repo_id[@revision]``."""

    repo_id: str
    revision: str = DEFAULT_REVISION

    @property
    def uri(self) -> str:
        suffix = "" if self.revision == DEFAULT_REVISION else f"@{self.revision}"
        return f"{HF_SCHEME}{self.repo_id}{suffix}"


@dataclass(frozen=True)
class ClaimSource:
    """``pvc://claim[/sub_path]``."""

    claim: str
    sub_path: str = ""

    @property
    def uri(self) -> str:
        return f"{PVC_SCHEME}{self.claim}" + (f"/{self.sub_path}" if self.sub_path else "")


ModelURI = HubSource | ClaimSource


def parse_model_uri(uri: str) -> ModelURI:
    """The source a model URI names; :class:`ModelURIError` for anything else."""
    if re.fullmatch(HF_URI_PATTERN, uri):
        body = uri[len(HF_SCHEME) :]
        repo, _, revision = body.partition("@")
        return HubSource(repo, revision or DEFAULT_REVISION)
    if re.fullmatch(PVC_URI_PATTERN, uri):
        claim, _, sub = uri[len(PVC_SCHEME) :].partition("/")
        return ClaimSource(claim, sub.strip("/"))
    raise ModelURIError(
        f"model URI {uri!r} is not hf://org/name[@revision] or pvc://claim[/sub/path]"
    )


def hub_local_dir(source: HubSource, cache_dir: str = MODEL_CACHE_MOUNT) -> str:
    """The directory a Hub source is downloaded into (and the engine loads from): one per
    repo and revision, so pods sharing a cache share each download and a new revision
    never overwrites the one running pods use."""
    revision = source.revision.replace("/", "--")
    return f"{cache_dir}/hf/{source.repo_id}/{revision}"
