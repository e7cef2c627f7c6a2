"""Pure builders: parsed specs in, Kubernetes manifests (plain dicts) out. No I/O."""

from .common import Manifest, PoolRef, pool_selector, selector_string
from .gateway import build_gateway_children, gateway_name, gateway_url, slo_table_name
from .pool import build_pool_children
from .processes import build_engine_config
from .slotable import SLOClassView, Verdict, build_slo_table, judge_classes, sha256_hex

__all__ = [
    "Manifest",
    "PoolRef",
    "SLOClassView",
    "Verdict",
    "build_engine_config",
    "build_gateway_children",
    "build_pool_children",
    "build_slo_table",
    "gateway_name",
    "gateway_url",
    "judge_classes",
    "pool_selector",
    "selector_string",
    "sha256_hex",
    "slo_table_name",
]
