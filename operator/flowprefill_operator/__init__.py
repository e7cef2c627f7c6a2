"""FlowPrefill Kubernetes operator: SLOClass and ServingPool custom resources.

Layout: ``models`` (pydantic CR models, the source of ``crds/``), ``builders`` (pure
spec -> manifests), ``status`` (pure observed state -> conditions), ``attainment``
(gateway metrics -> SLOClass status), ``kube`` (idempotent apply), ``controllers`` (one
module per controller: servingpool, gateway, sloclass, scraper; kopf indexes and memo),
``handlers`` (the kopf entry point; run with ``kopf run -m flowprefill_operator.handlers``).
Every file format, port, path and process description shared with the engine and gateway
comes from :mod:`flowprefill.contracts`.
"""

GROUP = "flowprefill.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGED_BY = "flowprefill-operator"
