"""FlowPrefill Kubernetes operator: SLOClass and ServingPool custom resources.

Layout: ``models`` (pydantic CR models, the source of ``crds/``), ``builders`` (pure
spec -> manifests), ``status`` (pure observed state -> conditions), ``attainment``
(gateway metrics -> SLOClass status), ``kube`` (idempotent apply), ``handlers`` (thin kopf
handlers; run with ``kopf run -m flowprefill_operator.handlers``).
"""

GROUP = "flowprefill.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGED_BY = "flowprefill-operator"
