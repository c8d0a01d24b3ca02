"""Builds the omnireduce image on a machine with a Docker engine but no image registry.

    .venv/bin/python docker/build_local_image.py [--tag omnireduce:local] [--reuse]

No base image is pulled: the root filesystem is assembled from this machine and fed
to ``docker import``. It holds

* ``/opt/python``: the running interpreter's base Python install (binary, libpython,
  the standard library without its tests, IDLE, tkinter, ensurepip, ...);
* ``/opt/venv``: a venv made with ``python -m venv --copies``, holding the project's
  runtime dependencies (pyproject.toml's, and what they require: numpy, pyzmq,
  msgpack, numba, llvmlite) copied from the running environment, so the versions the
  tests ran with, without their test suites; this project installed from a wheel
  with pip; no torch;
* the shared libraries all of that links against, found with ``ldd``, with an
  ``ld.so.cache`` made by ``ldconfig -r``;
* ``/opt/omnireduce/{cluster_worker,healthcheck}.py`` and a non-root user ``omni``
  (uid 10001) that the image runs as.

The image matches ``docker/Dockerfile``'s layout (same paths, user and default
command), so ``docker/compose.yaml`` runs either. Run it with the Python of the
environment whose packages should go in (``.venv/bin/python``); it needs ``docker``,
``ldd``, and root for ``ldconfig -r`` (without root the image gets an
``LD_LIBRARY_PATH`` instead). Bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("build_local_image")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TAG = "omnireduce:local"
#: Used when pyproject.toml cannot be read (Python < 3.11 has no tomllib).
FALLBACK_DEPS = ("numpy", "pyzmq", "msgpack", "numba", "prometheus-client")
#: Extras put in by default (none: the image needs only the core dependencies).
DEFAULT_EXTRAS: tuple[str, ...] = ()
#: Never copied, whatever asks for them: the image is CPU-only and has no torch.
NEVER = re.compile(r"^(torch|triton|nvidia-.*|numba-cuda|cuda-.*)$")
UID = GID = 10001
USER = "omni"
PY_DIR = "/opt/python"
VENV = "/opt/venv"
APP = "/opt/omnireduce"
LIB = "/usr/lib/x86_64-linux-gnu"
APP_FILES = ("cluster_worker.py", "healthcheck.py")
#: The project's packages in the image, and the files taken from each (None: all of them).
#: Of bench/, only what the ``omnireduce-calibrate`` console script needs (no torch or matplotlib).
PACKAGES: dict[str, tuple[str, ...] | None] = {
    "omnireduce": None, "aggregator": None, "worker": None, "bench": ("__init__.py", "calibrate.py"),
}

# Parts of the standard library a headless numeric service never imports.
STDLIB_SKIP_DIRS = {
    "test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages",
    "pydoc_data", "__phello__",
}
STDLIB_SKIP_PREFIX = ("config-",)
DYNLOAD_SKIP = re.compile(r"^(_test|_tkinter|xxlimited|_xxtestfuzz|_ctypes_test|xxsubtype)")
# Whole test suites shipped inside the wheels.
DIST_SKIP_DIRS = {"tests"}


class BuildError(RuntimeError):
    """The image could not be built; the message says which step failed."""


@dataclass
class Manifest:
    """What goes into the image: staged files plus files taken straight from this machine."""

    stage: Path
    #: arcname (no leading slash) -> source path on this machine
    files: dict[str, Path] = field(default_factory=dict)

    def add(self, arcname: str, src: Path) -> None:
        self.files.setdefault(arcname.lstrip("/"), src)


class Deadline:
    """Seconds left of the build's time budget, for subprocess timeouts."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, step: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise BuildError(f"out of time before {step}")
        return left


def _run(cmd: list[str], deadline: Deadline, step: str, **kw: object) -> subprocess.CompletedProcess:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=deadline.left(step), **kw)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired:
        raise BuildError(f"{step}: timed out: {' '.join(cmd)}") from None
    if res.returncode != 0:
        raise BuildError(f"{step} failed ({res.returncode}): {' '.join(cmd)}\n{res.stdout[-2000:]}{res.stderr[-3000:]}")
    return res


def _pyver() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def _base_python() -> Path:
    exe = Path(sys.base_prefix) / "bin" / _pyver()
    if not exe.exists():
        raise BuildError(f"no base interpreter at {exe}")
    return exe


def _libpython() -> Path | None:
    name = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    if name and libdir and (Path(libdir) / name).exists() and sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return Path(libdir) / name
    return None


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement(text: str) -> tuple[str, bool]:
    """The distribution a requirement names, and whether it applies here without extras."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    req = Requirement(text)
    return _canon(req.name), req.marker is None or req.marker.evaluate({"extra": ""})


def runtime_dists(extras: tuple[str, ...] = DEFAULT_EXTRAS) -> list[str]:
    """The installed distributions the project needs at run time: its dependencies, the given
    extras' where pyproject.toml defines them, and everything those require, minus :data:`NEVER`.

    Raises:
        BuildError: a dependency is not installed in the running environment.
    """
    try:
        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        wanted = list(project.get("dependencies", []))
        for extra in extras:
            wanted += project.get("optional-dependencies", {}).get(extra, [])
    except ImportError:
        wanted = list(FALLBACK_DEPS)
    todo = [name for name, applies in map(_requirement, wanted) if applies]
    seen: list[str] = []
    while todo:
        name = todo.pop()
        if name in seen or NEVER.match(name):
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            raise BuildError(f"{name} is not installed in {sys.prefix}; run with the project's venv") from None
        seen.append(name)
        todo += [n for n, applies in map(_requirement, dist.requires or []) if applies]
    return sorted(seen)


def inputs_hash(dists: list[str]) -> str:
    """A hash of everything the image is made from, so an unchanged image can be reused."""
    h = hashlib.sha256()
    h.update(sys.version.encode())
    for name in dists:
        h.update(f"{name}=={md.version(name)}".encode())
    files = [ROOT / "pyproject.toml", Path(__file__).resolve()] + [ROOT / "docker" / f for f in APP_FILES]
    for pkg, only in PACKAGES.items():
        files += sorted(p for p in (ROOT / pkg).rglob("*.py")) if only is None else [ROOT / pkg / f for f in only]
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _walk_stdlib(man: Manifest) -> None:
    src = Path(sys.base_prefix) / "lib" / _pyver()
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith(STDLIB_SKIP_PREFIX)]
        for f in filenames:
            if ".opt-" in f or f.endswith(".a"):
                continue
            if rel.name == "lib-dynload" and DYNLOAD_SKIP.match(f):
                continue
            man.add(f"{PY_DIR}/lib/{_pyver()}/{rel / f}", Path(dirpath) / f)


def _add_dists(man: Manifest, dists: list[str]) -> None:
    site = f"{VENV}/lib/{_pyver()}/site-packages"
    for name in dists:
        dist = md.distribution(name)
        for f in dist.files or ():
            parts = Path(f).parts
            if ".." in parts or DIST_SKIP_DIRS.intersection(parts[1:-1]):
                continue  # console scripts outside site-packages, test suites
            src = Path(dist.locate_file(f))
            if src.is_file():
                man.add(f"{site}/{f}", src)


def _make_venv(man: Manifest, deadline: Deadline) -> None:
    venv = man.stage / VENV.lstrip("/")
    _run([str(_base_python()), "-m", "venv", "--copies", "--without-pip", str(venv)], deadline, "python -m venv")
    # At run time the base install lives at /opt/python, not where it is on this machine.
    cfg = venv / "pyvenv.cfg"
    cfg.write_text(re.sub(r"(?m)^(home|executable|command) = .*\n", "", cfg.read_text())
                   + f"home = {PY_DIR}/bin\n")
    # Built from a copy so the build leaves nothing in the working tree.
    src = man.stage.parent / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg, only in PACKAGES.items():
        if only is None:
            shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (src / pkg).mkdir()
            for f in only:
                shutil.copy2(ROOT / pkg / f, src / pkg / f)
    wheels = man.stage.parent / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "-w", str(wheels), str(src)], deadline, "pip wheel (the project)")
    whl = sorted(wheels.glob("omnireduce-*.whl"))
    if not whl:
        raise BuildError(f"pip wheel made no omnireduce wheel in {wheels}")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed",
          "--no-warn-script-location", "--disable-pip-version-check", "--prefix", str(venv), str(whl[-1])],
         deadline, "pip install (the project)")
    for script in (venv / "bin").iterdir():
        if script.is_file() and not script.is_symlink() and script.name.startswith("omnireduce-"):
            text = script.read_text()
            script.write_text(re.sub(r"\A#!.*\n", f"#!{VENV}/bin/python\n", text))


def _elf_files(man: Manifest) -> list[Path]:
    out = []
    for src in man.files.values():
        if ".so" in src.name:
            out.append(src)
    out.append(_base_python())
    return out


def _ldd(paths: list[Path], deadline: Deadline) -> set[Path]:
    """System libraries the given ELF files load (not those they bundle next to themselves)."""
    found: set[Path] = set()
    missing: dict[str, set[str]] = {}
    own = (str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve()))
    for i in range(0, len(paths), 200):
        res = subprocess.run(["ldd", *map(str, paths[i:i + 200])], capture_output=True, text=True,
                             timeout=deadline.left("ldd"))
        current = ""
        for line in res.stdout.splitlines():
            if not line.startswith("\t"):
                current = line.rstrip(":")
                continue
            m = re.match(r"\s*(\S+) => (\S+) \(0x", line) or re.match(r"\s*(/\S+) \(0x", line)
            if "not found" in line:
                missing.setdefault(line.split()[0], set()).add(current)
            elif m:
                lib = Path(m.group(m.lastindex or 1))
                if not str(lib.resolve()).startswith(own):
                    found.add(lib)
    for lib, users in missing.items():
        # e.g. libtbb for numba's optional TBB threading layer: those modules just will not load.
        logger.info("%s not found for %s", lib, ", ".join(sorted(users))[:200])
    return found


def _system_libs(man: Manifest, deadline: Deadline) -> None:
    libs = _ldd(_elf_files(man), deadline)
    dest = man.stage / LIB.lstrip("/")
    dest.mkdir(parents=True, exist_ok=True)
    for lib in sorted(libs):
        if lib.name.startswith("ld-linux"):
            # The interpreter path baked into every binary (PT_INTERP).
            target = man.stage / "usr/lib64" / lib.name
            target.parent.mkdir(parents=True, exist_ok=True)
        else:
            target = dest / lib.name
        shutil.copy2(lib.resolve(), target)
    # glibc dlopens libgcc_s for thread cancellation; no ELF lists it.
    gcc = Path("/lib/x86_64-linux-gnu/libgcc_s.so.1")
    if gcc.exists() and not (dest / gcc.name).exists():
        shutil.copy2(gcc, dest / gcc.name)
    lp = _libpython()
    if lp is not None:
        (man.stage / PY_DIR.lstrip("/") / "lib").mkdir(parents=True, exist_ok=True)
        shutil.copy2(lp.resolve(), man.stage / PY_DIR.lstrip("/") / "lib" / lp.name)
    logger.info("%d system libraries", len(libs))


def _etc(man: Manifest) -> None:
    s = man.stage
    for d in ("etc", "tmp", "proc", "sys", "dev", "run", f"home/{USER}", "usr/bin", APP.lstrip("/"),
              f"{PY_DIR.lstrip('/')}/bin"):
        (s / d).mkdir(parents=True, exist_ok=True)
    (s / "etc/passwd").write_text(f"root:x:0:0:root:/root:/usr/sbin/nologin\n"
                                  f"{USER}:x:{UID}:{GID}:omnireduce:/home/{USER}:/usr/sbin/nologin\n")
    (s / "etc/group").write_text(f"root:x:0:\n{USER}:x:{GID}:\n")
    (s / "etc/nsswitch.conf").write_text("passwd: files\ngroup: files\nhosts: files dns\n")
    (s / "etc/ld.so.conf").write_text(f"{PY_DIR}/lib\n{LIB}\n")
    for name in ("lib", "lib64", "bin"):
        os.symlink(f"usr/{name}", s / name)
    for f in APP_FILES:
        shutil.copy2(ROOT / "docker" / f, s / APP.lstrip("/") / f)
    py = s / PY_DIR.lstrip("/") / "bin"
    shutil.copy2(_base_python(), py / _pyver())
    os.symlink(_pyver(), py / "python3")
    os.symlink(f"{VENV}/bin/python", s / "usr/bin/python3")


def _ldconfig(man: Manifest, deadline: Deadline) -> bool:
    if os.geteuid() != 0 or not shutil.which("ldconfig"):
        return False
    # ldconfig -r chroots into the stage, where the libraries are already in place.
    _run(["ldconfig", "-r", str(man.stage)], deadline, "ldconfig -r")
    return (man.stage / "etc/ld.so.cache").exists()


def _entries(man: Manifest) -> Iterator[tuple[str, Path]]:
    staged = []
    for dirpath, dirnames, filenames in os.walk(man.stage):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            staged.append((str(p.relative_to(man.stage)), p))
    names = {a for a, _ in staged}
    yield from staged
    # Parent directories of the files taken from this machine, then the files.
    dirs: set[str] = set()
    for arc in man.files:
        parts = arc.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    for d in sorted(dirs - names):
        yield d, man.stage  # any directory; only its type matters
    for arc, src in sorted(man.files.items()):
        if arc not in names:
            yield arc, src


def _tarinfo(tar: tarfile.TarFile, arc: str, src: Path, is_dir: bool) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(src), arcname=arc)
    if is_dir:
        info.type, info.size = tarfile.DIRTYPE, 0
    owned = arc == "tmp" or arc == f"home/{USER}" or arc.startswith(f"home/{USER}/")
    info.uid = info.gid = UID if owned and arc != "tmp" else 0
    info.uname = info.gname = USER if info.uid else "root"
    if arc == "tmp":
        info.mode = 0o1777
    elif info.isdir():
        info.mode = 0o755
    elif info.isreg():
        info.mode = 0o755 if info.mode & 0o111 else 0o644
    return info


def import_rootfs(man: Manifest, tag: str, changes: list[str], deadline: Deadline) -> int:
    """Streams the root filesystem into ``docker import``; returns the bytes written."""
    cmd = ["docker", "import"] + [a for c in changes for a in ("--change", c)] + ["-", tag]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None
    total = 0
    try:
        with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for arc, src in _entries(man):
                is_dir = src == man.stage or (src.is_dir() and not src.is_symlink())
                info = _tarinfo(tar, arc, src, is_dir)
                if info.isreg():
                    total += info.size
                    with open(src, "rb") as fh:
                        tar.addfile(info, fh)
                else:
                    tar.addfile(info)
                if time.monotonic() > deadline.end:
                    raise BuildError("out of time while writing the root filesystem")
        out, err = proc.communicate(timeout=deadline.left("docker import"))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise BuildError(f"docker import failed ({proc.returncode}): {err.decode(errors='replace')[-2000:]}")
    return total


def _image_id(tag: str) -> str | None:
    res = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", tag],
                         capture_output=True, text=True, timeout=30)
    return res.stdout.strip() if res.returncode == 0 else None


def image_hash(tag: str) -> str | None:
    """The inputs hash recorded in an existing image, or None."""
    res = subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Env}}", tag],
                         capture_output=True, text=True, timeout=30)
    m = re.search(r"OMNIREDUCE_IMAGE_INPUTS=([0-9a-f]+)", res.stdout) if res.returncode == 0 else None
    return m.group(1) if m else None


def build(tag: str = DEFAULT_TAG, timeout: float = 240.0, reuse: bool = False,
          extras: tuple[str, ...] = DEFAULT_EXTRAS) -> dict[str, object]:
    """Builds (or, with ``reuse``, keeps an identical) image; returns what was done.

    Args:
        tag: the image name to give it.
        timeout: seconds the whole build may take.
        reuse: keep an existing image with this tag made from the same inputs.
        extras: the project's extras whose packages go in too (where pyproject.toml defines them).

    Raises:
        BuildError: a step failed or ran out of time.
    """
    t0 = time.monotonic()
    deadline = Deadline(timeout)
    dists = runtime_dists(extras)
    digest = inputs_hash(dists)
    if reuse and image_hash(tag) == digest:
        return {"tag": tag, "reused": True, "seconds": round(time.monotonic() - t0, 1)}
    with tempfile.TemporaryDirectory(prefix="omnireduce-rootfs-") as tmp:
        man = Manifest(stage=Path(tmp) / "rootfs")
        man.stage.mkdir()
        _etc(man)
        _make_venv(man, deadline)
        _walk_stdlib(man)
        _add_dists(man, dists)
        _system_libs(man, deadline)
        env = [f"PATH={VENV}/bin:/usr/bin:/bin", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8", f"HOME=/home/{USER}",
               "NUMBA_CACHE_DIR=/tmp/numba-cache", f"OMNIREDUCE_IMAGE_INPUTS={digest}"]
        if not _ldconfig(man, deadline):
            env.append(f"LD_LIBRARY_PATH={PY_DIR}/lib:{LIB}")
        changes = [f"ENV {e}" for e in env] + [
            f"USER {USER}", f"WORKDIR /home/{USER}", "EXPOSE 5555",
            'CMD ["python", "-m", "aggregator", "--listen", "tcp://0.0.0.0:5555"]',
        ]
        old = _image_id(tag)
        size = import_rootfs(man, tag, changes, deadline)
    if old and old != _image_id(tag):
        # The tag moved to the new image; drop the old one unless a container still uses it.
        subprocess.run(["docker", "rmi", old], capture_output=True, timeout=60)
    return {"tag": tag, "reused": False, "bytes": size, "dists": dists, "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tag", default=DEFAULT_TAG)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds the build may take")
    p.add_argument("--reuse", action="store_true", help="keep an existing image built from the same inputs")
    p.add_argument("--extras", default=",".join(DEFAULT_EXTRAS),
                   help="comma-separated extras of the project to put in too, where defined (default %(default)s)")
    args = p.parse_args(argv)
    try:
        res = build(args.tag, args.timeout, args.reuse, tuple(e for e in args.extras.split(",") if e))
    except BuildError as e:
        logger.error("%s", e)
        return 1
    logger.info("%s", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
