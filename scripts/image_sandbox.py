"""Run a built image's process the way a hardened pod runs it, without a container runtime.

``podman run`` does not work in this sandbox and ``buildah run`` cannot make the root
filesystem read-only (remounting it read-only makes buildah 1.28 panic on exit and lose the
exit status), so the conditions of the operator's pods are set up here with the kernel:

- the image's root filesystem (``buildah mount`` of a fresh working container) is bound
  **read-only** (``readOnlyRootFilesystem: true``);
- writable are only the pod's emptyDirs (fresh tmpfs each) and ``/dev/shm``; ConfigMaps
  and PVCs are bound read-only; ``/proc`` and the host's ``/dev`` are mounted as a runtime
  would;
- the process runs as the image's ``USER``, which must be numeric and not 0
  (``runAsNonRoot`` refuses a name it cannot verify), or as the UID and GID a platform
  picks (``run_as``: OpenShift's restricted-v2 runs an arbitrary UID such as 1000650000
  with GID 0 and no passwd entry), with no supplementary groups, no capabilities and
  ``no_new_privs`` (``allowPrivilegeEscalation: false``), in its own mount and PID
  namespaces (it shares the host's network: ports are picked free).

:func:`inspect_processes` reads back, for every process of the image, what the kernel says
about it (``/proc/<pid>/status`` and its mount table), so the checks do not trust the
image's own report. Needs root and util-linux (``unshare``, ``setpriv``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WORK_DIR = Path(os.environ.get("FLOWPREFILL_IMAGES_DIR", "/var/tmp/flowprefill-images"))

# Runs as root in the new mount namespace: builds the pod's filesystem, then execs the rest
# of its arguments. Arguments: rootfs, new root, mount specs ("tmpfs=/path" or
# "ro=/host/path:/path"), "--", command.
_MOUNT_SCRIPT = r"""
set -eu
src=$1 root=$2
shift 2
mount --bind "$src" "$root"
mount -o remount,bind,ro "$root"
mount -t proc -o nosuid,nodev,noexec proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o nosuid,nodev,mode=1777 shm "$root/dev/shm"
while [ "$1" != -- ]; do
    case $1 in
        tmpfs=*) mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs "$root${1#tmpfs=}" ;;
        ro=*) spec=${1#ro=}
              mount --bind "${spec%%:*}" "$root${spec#*:}"
              mount -o remount,bind,ro "$root${spec#*:}" ;;
    esac
    shift
done
shift
exec "$@"
"""


@dataclass(frozen=True)
class ImageConfig:
    """What of an image's OCI config a run uses."""

    user: str
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    workdir: str

    @classmethod
    def of(cls, image: str) -> ImageConfig:
        raw = json.loads(_buildah("inspect", "--type", "image", image))
        config = raw["OCIv1"]["config"]
        env = dict(item.split("=", 1) for item in config.get("Env") or [])
        return cls(
            user=config.get("User") or "",
            env=env,
            entrypoint=list(config.get("Entrypoint") or []),
            cmd=list(config.get("Cmd") or []),
            workdir=config.get("WorkingDir") or "/",
        )

    def uid_gid(self) -> tuple[int, int]:
        """The numeric user; a name, an empty user or root is what runAsNonRoot refuses."""
        user, _, group = self.user.partition(":")
        if not user.isdigit() or int(user) == 0:
            raise SystemExit(f"image USER {self.user!r}: runAsNonRoot needs a numeric non-0 UID")
        return int(user), int(group) if group.isdigit() else int(user)


@dataclass(frozen=True)
class PodMounts:
    """The pod's volumes as this run reproduces them: emptyDirs and read-only sources."""

    empty_dirs: list[str] = field(default_factory=list)
    read_only: dict[str, Path] = field(default_factory=dict)
    """Mount path in the container -> file or directory on the host."""


def _buildah(*args: str) -> str:
    # The storage driver scripts/build_images.sh uses unless told otherwise.
    env = {**os.environ, "STORAGE_DRIVER": os.environ.get("STORAGE_DRIVER", "overlay")}
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"buildah {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


@dataclass
class Sandboxed:
    """A running process of an image (see the module docstring)."""

    proc: subprocess.Popen[str]
    log: Path
    root: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def run_in_image(
    image: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    mounts: PodMounts,
    name: str,
    run_as: tuple[int, int] | None = None,
) -> Iterator[Sandboxed]:
    """Start ``argv`` in ``image`` (env: the image's, overridden by ``env``, as Kubernetes
    merges a container's env) as the image's USER, or as ``run_as`` (uid, gid) where the
    platform assigns one; stops it and removes the working container on exit."""
    config = ImageConfig.of(image)
    uid, gid = config.uid_gid()  # checked even with run_as: runAsNonRoot reads the image's
    if run_as is not None:
        uid, gid = run_as
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    tag = f"{name}-{os.getpid()}"  # two smoke runs at once must not share a container or log
    ctr = _buildah("from", "--pull=never", "--name", f"flowprefill-smoke-{tag}", image)
    try:
        rootfs = Path(_buildah("mount", ctr))
        # Mount points for the pod's volumes, made in the container's own writable layer as
        # a runtime makes them (the image stays as built).
        for target, source in mounts.read_only.items():
            point = rootfs / target.lstrip("/")
            if source.is_dir():
                point.mkdir(parents=True, exist_ok=True)
            else:
                point.parent.mkdir(parents=True, exist_ok=True)
                point.touch()
        for target in mounts.empty_dirs:
            (rootfs / target.lstrip("/")).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"{tag}-root-", dir=WORK_DIR))
        log = WORK_DIR / f"{tag}.log"
        specs = [f"tmpfs={d}" for d in mounts.empty_dirs]
        specs += [f"ro={src}:{dst}" for dst, src in mounts.read_only.items()]
        command = [
            "unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private",
            "--", "/bin/sh", "-c", _MOUNT_SCRIPT, "sh", str(rootfs), str(root), *specs, "--",
            "setpriv", "--no-new-privs", "--clear-groups", "--",
            "unshare", f"--root={root}", f"--wd={config.workdir}",
            f"--setgid={gid}", f"--setuid={uid}", "--", *argv,
        ]  # fmt: skip
        full_env = {**config.env, **env}
        full_env["PATH"] = full_env.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin"
        with log.open("w") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=full_env, text=True
            )
        try:
            yield Sandboxed(proc=proc, log=log, root=root)
        finally:
            if proc.poll() is None:
                proc.terminate()  # --kill-child: the namespace's processes go with it
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            with contextlib.suppress(OSError):
                root.rmdir()
    finally:
        with contextlib.suppress(SystemExit):
            _buildah("rm", ctr)


@dataclass(frozen=True)
class ProcessFacts:
    """What the kernel reports about one process of the image."""

    pid: int
    command: str
    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    no_new_privs: bool
    cap_eff: int
    root_read_only: bool
    writable_mounts: tuple[str, ...]
    """Mount points outside /proc, /dev and /sys that are not read-only."""


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _facts(pid: int) -> ProcessFacts:
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )

    def ints(key: str) -> tuple[int, ...]:
        return tuple(int(v) for v in status[key].split())

    root_ro, writable = False, []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        point, options = fields[4], fields[5].split(",")
        if point == "/":
            root_ro = "ro" in options
        elif "rw" in options and not point.startswith(("/proc", "/dev", "/sys")):
            writable.append(point)
    return ProcessFacts(
        pid=pid,
        command=Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ").strip(),
        uids=ints("Uid"),
        gids=ints("Gid"),
        groups=ints("Groups"),
        no_new_privs=status["NoNewPrivs"].strip() == "1",
        cap_eff=int(status["CapEff"].strip(), 16),
        root_read_only=root_ro,
        writable_mounts=tuple(sorted(writable)),
    )


def inspect_processes(run: Sandboxed) -> list[ProcessFacts]:
    """Every live process of the image (the namespace's, below the host-side unshare)."""
    facts = []
    for pid in _descendants(run.proc.pid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            facts.append(_facts(pid))
    return facts


def check_hardened(
    facts: Sequence[ProcessFacts], uid: int, empty_dirs: Sequence[str], gid: int | None = None
) -> None:
    """Raise AssertionError unless every process is ``uid`` with nothing to escalate to, on
    a read-only root whose only writable mounts are the pod's emptyDirs. ``gid``: the GID
    the platform assigned (OpenShift: 0), the only group allowed; None: any but 0."""
    assert facts, "no process of the image is running"
    expected = {d for d in empty_dirs if not d.startswith("/dev/")}  # /dev/shm: not listed
    for f in facts:
        where = f"pid {f.pid} ({f.command[:80]})"
        assert set(f.uids) == {uid}, f"{where}: uids {f.uids}, expected {uid}"
        if gid is None:
            assert 0 not in f.gids and 0 not in f.groups, f"{where}: gids {f.gids} {f.groups}"
        else:
            assert set(f.gids) == {gid} and set(f.groups) <= {gid}, (
                f"{where}: gids {f.gids} groups {f.groups}, expected only {gid}"
            )
        assert f.no_new_privs, f"{where}: no_new_privs not set"
        assert f.cap_eff == 0, f"{where}: effective capabilities {f.cap_eff:#x}"
        assert f.root_read_only, f"{where}: / is not mounted read-only"
        assert set(f.writable_mounts) == expected, (
            f"{where}: writable mounts {f.writable_mounts}, the pod's emptyDirs {sorted(expected)}"
        )


_WRITE_PROBE = """
import errno, os, sys
for folder in sys.argv[1:]:
    try:
        os.close(os.open(os.path.join(folder, ".probe"), os.O_CREAT | os.O_WRONLY))
        print(folder, "writable")
    except OSError as e:
        print(folder, errno.errorcode[e.errno])
"""


def probe_writes(
    image: str, mounts: PodMounts, name: str, run_as: tuple[int, int] | None = None
) -> dict[str, str]:
    """Try to create a file, as the image's user (or ``run_as``), in each emptyDir and in
    /, /etc, /opt, /usr and the workdir: the kernel's answer per folder (``writable``,
    ``EROFS``, ...)."""
    folders = [*mounts.empty_dirs, "/", "/etc", "/opt", "/usr", ImageConfig.of(image).workdir]
    argv = ["python3", "-c", _WRITE_PROBE, *folders]
    with run_in_image(image, argv, {}, mounts, f"{name}-writes", run_as) as run:
        if run.proc.wait(timeout=120) != 0:
            raise AssertionError(run.output()[-2000:])
        answers = dict(line.rsplit(" ", 1) for line in run.output().splitlines() if line.strip())
    for folder, answer in answers.items():
        want = "writable" if folder in mounts.empty_dirs else "EROFS"
        assert answer == want, f"{folder}: {answer}, expected {want}"
    return answers


def host_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} not found (util-linux / buildah)")
    return path
