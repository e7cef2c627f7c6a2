"""Custom resource models (the single source of ``crds/``) and the file contracts."""

from .common import Condition, CRModel, LabelSelector
from .configs import Endpoint, EngineConfig, GatewayConfig, SLOTable, SLOTableClass, SLOTableMatch
from .servingpool import EngineSettings, ModelSource, ServingPoolSpec, ServingPoolStatus
from .sloclass import MatchRules, SLOClassSpec, SLOClassStatus

__all__ = [
    "CRModel",
    "Condition",
    "Endpoint",
    "EngineConfig",
    "EngineSettings",
    "GatewayConfig",
    "LabelSelector",
    "MatchRules",
    "ModelSource",
    "SLOClassSpec",
    "SLOClassStatus",
    "SLOTable",
    "SLOTableClass",
    "SLOTableMatch",
    "ServingPoolSpec",
    "ServingPoolStatus",
]
