"""The image smoke run (scripts/smoke_images.py, scripts/image_sandbox.py).

The pure parts (pod spec -> what the run mounts, the hardening verdict) are tested
everywhere. The smoke run itself needs buildah, root and the built images, and is opt-in
(``FLOWPREFILL_IMAGE_SMOKE=1``): images built earlier may predate the checkout under test,
so a suite that found them would judge stale images. scripts/build_images.sh builds and
smoke-runs them in one go (docs/images.md); set the variable to re-run the smoke checks
from pytest against images just built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import smoke_images  # noqa: E402
from flowprefill_operator.builders.gateway import build_gateway_children  # noqa: E402
from flowprefill_operator.builders.pool import build_pool_children  # noqa: E402
from flowprefill_operator.settings import OperatorSettings  # noqa: E402
from image_sandbox import ImageConfig, ProcessFacts, _facts, check_hardened  # noqa: E402

from flowprefill.contracts import SLOTable  # noqa: E402
from flowprefill.contracts.deployment import ENGINE_CONFIG_PATH, GATEWAY_CONFIG_PATH  # noqa: E402

TABLE = SLOTable.model_validate(
    {"default_class": "chat", "classes": [{"name": "chat", "task_type": "text",
     "ttft_slo_ms": 500, "priority": 1, "attainment_target": 0.9}]}
)  # fmt: skip


def test_prefill_pod_becomes_tmpfs_emptydirs_and_read_only_config_and_model(
    tmp_path: Path,
) -> None:
    children = build_pool_children(smoke_images.pool("prefill"), OperatorSettings())
    model = tmp_path / "pvc"
    model.mkdir()
    argv, env, mounts = smoke_images.pod_container(children, model, tmp_path / "files")
    assert argv[:2] == ["flowprefill", "serve-prefill"]
    assert "$(" not in " ".join(argv) + " ".join(env.values())  # POD_IP etc. expanded
    assert env["HOME"] == "/tmp"
    assert sorted(mounts.empty_dirs) == ["/dev/shm", "/tmp"]
    # pvc://models/tiny-llama: the claim's subdirectory, read-only where the engine reads it.
    assert mounts.read_only[smoke_images.MODEL_MOUNT] == model / smoke_images.MODEL
    engine = mounts.read_only[ENGINE_CONFIG_PATH]  # a subPath mount: the one file
    assert engine.is_file() and '"model_path"' in engine.read_text()


def test_gateway_pod_mounts_its_config_file_and_slo_directory(tmp_path: Path) -> None:
    pools = [smoke_images.pool("prefill"), smoke_images.pool("decode")]
    children = build_gateway_children(pools, TABLE, OperatorSettings())
    argv, _, mounts = smoke_images.pod_container(children, tmp_path, tmp_path / "files")
    assert argv[:2] == ["flowprefill", "serve-gateway"]
    assert mounts.empty_dirs == ["/tmp"]
    assert mounts.read_only[GATEWAY_CONFIG_PATH].is_file()
    slo_dir = mounts.read_only[argv[argv.index("--slo-table") + 1].rsplit("/", 1)[0]]
    assert (slo_dir / "slo-table.json").is_file()


def test_unsupported_volume_is_refused(tmp_path: Path) -> None:
    children = build_pool_children(smoke_images.pool("prefill"), OperatorSettings())
    pod = next(c for c in children if c["kind"] == "Deployment")["spec"]["template"]["spec"]
    pod["volumes"][0] = {"name": pod["volumes"][0]["name"], "hostPath": {"path": "/x"}}
    with pytest.raises(SystemExit, match="not reproduced"):
        smoke_images.pod_container(children, tmp_path, tmp_path / "files")


@pytest.mark.parametrize("user", ["", "root", "0", "0:0", "flowprefill"])
def test_run_as_non_root_needs_a_numeric_non_zero_user(user: str) -> None:
    config = ImageConfig(user=user, env={}, entrypoint=[], cmd=[], workdir="/")
    with pytest.raises(SystemExit, match="runAsNonRoot"):
        config.uid_gid()


def test_numeric_user_and_group() -> None:
    assert ImageConfig("10001:10002", {}, [], [], "/").uid_gid() == (10001, 10002)
    assert ImageConfig("10001", {}, [], [], "/").uid_gid() == (10001, 10001)


HARDENED = ProcessFacts(
    pid=1, command="flowprefill serve-prefill", uids=(10001,) * 4, gids=(10001,) * 4,
    groups=(), no_new_privs=True, cap_eff=0, root_read_only=True, writable_mounts=("/tmp",),
)  # fmt: skip


def test_hardened_process_passes() -> None:
    check_hardened([HARDENED], 10001, ["/tmp", "/dev/shm"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"uids": (10001, 0, 10001, 10001)}, "uids"),
        ({"groups": (0,)}, "gids"),
        ({"no_new_privs": False}, "no_new_privs"),
        ({"cap_eff": 1 << 21}, "capabilities"),
        ({"root_read_only": False}, "read-only"),
        ({"writable_mounts": ("/tmp", "/var/lib/data")}, "writable mounts"),
    ],
)
def test_each_weakness_is_reported(change: dict[str, object], message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_hardened([replace(HARDENED, **change)], 10001, ["/tmp"])  # type: ignore[arg-type]


def test_no_process_is_a_failure() -> None:
    with pytest.raises(AssertionError, match="no process"):
        check_hardened([], 10001, ["/tmp"])


def test_facts_are_read_from_the_kernel() -> None:
    me = _facts(os.getpid())
    assert me.uids[0] == os.getuid() and me.gids[0] == os.getgid()
    assert "python" in me.command or "pytest" in me.command
    # This test process is not in a hardened sandbox: its root is writable.
    assert not me.root_read_only


SMOKE_ENV = "FLOWPREFILL_IMAGE_SMOKE"


def _skip_reason(name: str) -> str | None:
    if os.environ.get(SMOKE_ENV) != "1":
        return f"opt-in: {SMOKE_ENV}=1 (after scripts/build_images.sh built the images)"
    if shutil.which("buildah") is None:
        return "buildah not installed (images are built by scripts/build_images.sh)"
    if os.geteuid() != 0:
        return "the smoke run needs root (mounts, chroot)"
    found = subprocess.run(
        ["buildah", "images", "--quiet", f"localhost/flowprefill/{name}:dev"],
        capture_output=True,
        env={**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "overlay")},
    )
    if found.returncode != 0:
        return f"image localhost/flowprefill/{name}:dev not built (scripts/build_images.sh)"
    return None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["operator", "gateway", "prefill", "decode"])
def test_image_smoke_run(name: str) -> None:
    if reason := _skip_reason(name):
        pytest.skip(reason)
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "smoke_images.py"), name],
        capture_output=True,
        text=True,
        env={**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "overlay")},
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert f"{name}: OK" in done.stdout


ARBITRARY_FACTS = replace(
    HARDENED, uids=(1000650000,) * 4, gids=(0,) * 4, groups=(0,)
)  # what the kernel shows for OpenShift's restricted-v2: an assigned UID, GID 0


def test_an_assigned_uid_with_gid_0_passes_when_the_platform_assigned_gid_0() -> None:
    check_hardened([ARBITRARY_FACTS], 1000650000, ["/tmp"], gid=0)


def test_gid_0_still_fails_where_the_run_was_the_images_own_user() -> None:
    with pytest.raises(AssertionError, match="uids"):
        check_hardened([ARBITRARY_FACTS], 10001, ["/tmp"])
    with pytest.raises(AssertionError, match="gids"):
        check_hardened([replace(ARBITRARY_FACTS, uids=(10001,) * 4)], 10001, ["/tmp"])


def test_an_assigned_gid_allows_no_other_group() -> None:
    other = replace(ARBITRARY_FACTS, groups=(0, 10001))
    with pytest.raises(AssertionError, match="expected only 0"):
        check_hardened([other], 1000650000, ["/tmp"], gid=0)


def test_the_smoke_run_uses_an_arbitrary_uid_outside_the_images() -> None:
    uid, gid = smoke_images.ARBITRARY
    assert gid == 0 and uid not in (0, 10001)
