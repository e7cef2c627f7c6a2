"""The beat connector's configuration: how a vLLM decode is told to send its step beats
to the prefill engines beside it (docs/kv.md, "Decode beats"; the beats themselves and
their listener: :mod:`flowprefill.kv.beats`). A contract because ``flowprefill up`` and
the operator both render it into decode's ``--kv-transfer-config``."""

from __future__ import annotations

from typing import Any

BEAT_CONNECTOR = "FlowPrefillBeatConnector"
BEAT_CONNECTOR_MODULE = "flowprefill.kv.beat_connector"
SOCKET_KEY = "beat_socket"
"""``kv_connector_extra_config`` key of the beat connector: the listener's socket path."""
MAX_SOCKET_PATH_BYTES = 107
"""Longest beat socket path: a Unix socket address (``sun_path``) holds 107 bytes and a NUL
on Linux."""


def socket_paths(value: object) -> tuple[str, ...]:
    """The beat connector's ``beat_socket`` setting: one path, or a list of paths (every
    prefill instance that shares the device with this decode); ValueError otherwise."""
    paths = (value,) if isinstance(value, str) else value
    if (
        not isinstance(paths, list | tuple)
        or not paths
        or not all(isinstance(p, str) and p for p in paths)
    ):
        raise ValueError(
            f"{SOCKET_KEY} must be a socket path or a non-empty list of them, got {value!r}"
        )
    return tuple(paths)


def beat_connector_config(
    socket_path: str | list[str] | tuple[str, ...], kv_role: str = "kv_consumer"
) -> dict[str, Any]:
    """vLLM ``--kv-transfer-config`` entry of the beat connector alone (beats to one
    socket, or to each of several)."""
    paths = socket_paths(socket_path)
    return {
        "kv_connector": BEAT_CONNECTOR,
        "kv_connector_module_path": BEAT_CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": {SOCKET_KEY: paths[0] if len(paths) == 1 else list(paths)},
    }


# Top-level fields vLLM reads from the outer config (the scheduler's failure policy, the
# buffer device NIXL registers): kept on the MultiConnector as well as the child.
_SHARED_FIELDS = ("kv_role", "kv_buffer_device", "kv_load_failure_policy")


def with_beats(
    config: dict[str, Any] | None, socket_path: str | list[str] | tuple[str, ...]
) -> dict[str, Any]:
    """``config`` (a vLLM ``--kv-transfer-config``, or None for none) plus the beat
    connector, through vLLM's ``MultiConnector``: ``config``'s connector comes first, so
    it alone answers how many tokens are loaded (the beat connector always answers 0)."""
    beats = beat_connector_config(socket_path, str((config or {}).get("kv_role", "kv_consumer")))
    if config is None:
        return beats
    if config.get("kv_connector") == "MultiConnector":
        extra = dict(config.get("kv_connector_extra_config") or {})
        extra["connectors"] = [*extra.get("connectors", []), beats]
        return {**config, "kv_connector_extra_config": extra}
    outer: dict[str, Any] = {"kv_connector": "MultiConnector"}
    outer.update({k: config[k] for k in _SHARED_FIELDS if k in config})
    outer["kv_connector_extra_config"] = {"connectors": [dict(config), beats]}
    return outer
