"""Custom resource models (the single source of ``crds/``) and the file contracts."""

from .common import Condition, CRModel, LabelSelector
from .configs import Endpoint, EngineConfig, GatewayConfig, SLOTable, SLOTableClass, SLOTableMatch
from .podoverlay import (
    Affinity,
    ContainerSecurityContext,
    EnvFromSource,
    EnvVar,
    PodOverlay,
    PodSecurityContext,
    Toleration,
    TopologySpreadConstraint,
    Volume,
    VolumeMount,
)
from .servingpool import (
    ColocatedSettings,
    EngineSettings,
    ModelSource,
    ServingPoolSpec,
    ServingPoolStatus,
)
from .sloclass import MatchRules, SLOClassSpec, SLOClassStatus

__all__ = [
    "Affinity",
    "CRModel",
    "ColocatedSettings",
    "Condition",
    "ContainerSecurityContext",
    "Endpoint",
    "EngineConfig",
    "EngineSettings",
    "EnvFromSource",
    "EnvVar",
    "GatewayConfig",
    "LabelSelector",
    "MatchRules",
    "ModelSource",
    "PodOverlay",
    "PodSecurityContext",
    "SLOClassSpec",
    "SLOClassStatus",
    "SLOTable",
    "SLOTableClass",
    "SLOTableMatch",
    "ServingPoolSpec",
    "ServingPoolStatus",
    "Toleration",
    "TopologySpreadConstraint",
    "Volume",
    "VolumeMount",
]
