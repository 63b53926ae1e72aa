"""A wheelhouse for air-gapped GPU nodes: `build` downloads the binary wheels of draftport's
dependencies at requirements.lock's pins for the cluster's interpreter and platform, adds
draftport's own wheel and writes MANIFEST.json; `verify` checks a wheelhouse against its manifest;
`install` verifies, then installs from it with pip and nothing else (no index, no pip config).

    python tools/wheelhouse.py build --out wheelhouse --python-version 3.12 --set core
    python tools/wheelhouse.py verify wheelhouse
    python tools/wheelhouse.py install --wheelhouse wheelhouse [--venv PATH]

Torch stays out unless `--torch`: a cluster's torch is a CUDA build matched to its driver, and it is
expected installed already (`install` refuses in one line when it is not). Standard library only:
`verify` and `install` run on the cluster's bare interpreter. Every problem is one line naming the
file or package, exit status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "MANIFEST.json"
FORMAT = 1
# the extras each set installs (core: every step of the plan, its report too; no snakemake/dvc/mlflow)
SETS = {"core": ["report"], "full": ["pipeline"]}
# Pinned dependencies PyPI has as sdists only (dvc's omegaconf, snakemake): pure Python, so their
# wheels are built here; any other package without a binary wheel fails the build, named.
SDISTS = ("antlr4-python3-runtime", "connection-pool")
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}  # PEP 600's aliases
LINUX_TAG = re.compile(r"(?:manylinux(?:_\d+_\d+|\d+)|linux)_(\w+)")  # a Linux platform tag; group 1: its arch
FACTS = (
    "import sys, platform; print(sys.implementation.name, '%d.%d' % sys.version_info[:2], "
    "sys.platform, platform.machine())"
)


class WheelhouseError(Exception):
    """One line: what (a file, a package) and what is wrong with it."""


# ---- reading the project ---------------------------------------------------------------------------
def canonical(name: str) -> str:
    """PEP 503's name: the lock, pyproject and wheel file names spell names differently."""
    return re.sub(r"[-_.]+", "-", name).lower()


def req_name(req: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))


def read_lock(lock: Path) -> dict[str, str]:
    """{canonical name: pinned version} of every `name==version` line."""
    pins = {}
    for line in lock.read_text().splitlines():
        m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+).*", line)
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(wheel_set: str, torch: bool) -> list[str]:
    """pyproject's requirement strings of a set; torch only when asked (the cluster brings its own)."""
    meta = project()
    reqs = list(meta["dependencies"])
    for extra in SETS[wheel_set]:
        reqs += meta["optional-dependencies"][extra]
    return [r for r in reqs if torch or req_name(r) != "torch"]


def install_spec(wheel_set: str) -> str:
    extras = SETS[wheel_set]
    return f"draftport[{','.join(extras)}]" if extras else "draftport"


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD, whether tracked files differ from it); (None, None) outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        # --no-optional-locks: a read must not rewrite the index under a concurrent git command
        status = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return head, bool(status.strip())


# ---- building ------------------------------------------------------------------------------------------
def expand_platforms(platforms: list[str]) -> list[str]:
    """manylinux_2_Y_ARCH also accepts every older glibc's wheels: pip's --platform does not infer them."""
    out: list[str] = []
    for plat in platforms:
        m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", plat)
        more = [plat]
        if m:
            arch = m.group(2)
            more = [f"manylinux_2_{y}_{arch}" for y in range(int(m.group(1)), 4, -1)]
            more += [
                f"{LEGACY_MANYLINUX[y]}_{arch}" for y in sorted(LEGACY_MANYLINUX, reverse=True) if y <= int(m.group(1))
            ]
        out += [p for p in more if p not in out]
    return out


class NoWheel(WheelhouseError):
    """pip found no binary wheel for this package (canonical name) at its pin."""

    def __init__(self, name: str, message: str):
        super().__init__(message)
        self.name = name


def pip_download(
    reqs: list[str], dest: Path, python: str, platforms: list[str], lock: Path, pip_args: list[str] = ()
) -> None:
    """Binary wheels only, for the target interpreter and platform, at the lock's pins."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--only-binary=:all:",
        "--implementation",
        "cp",
        "--python-version",
        python,
        "--dest",
        str(dest),
        "-c",
        str(lock),
        "--progress-bar",
        "off",
        *[a for p in platforms for a in ("--platform", p)],
        *pip_args,
        *reqs,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise download_problem(r.stdout + r.stderr, python, platforms)


def download_problem(out: str, python: str, platforms: list[str]) -> WheelhouseError:
    """pip's failure as one line naming the package it found no wheel for."""
    # a pin with no wheel shows as "No matching distribution", or as a conflict with the lock's constraint
    m = re.search(r"No matching distribution found for (\S+)", out) or re.search(
        r"The user requested \(constraint\) (\S+)", out
    )
    if m:
        return NoWheel(
            req_name(m.group(1)),
            f"{m.group(1)}: no binary wheel for cp{python.replace('.', '')} on "
            f"{platforms[0]} (pip download --only-binary=:all: found none on the index)",
        )
    errors = [ln for ln in out.splitlines() if ln.startswith("ERROR:")]
    last = errors[-1] if errors else (out.strip().splitlines() or ["no output"])[-1]
    return WheelhouseError(f"pip download failed: {last}")


def fetch(
    reqs: list[str],
    dest: Path,
    python: str,
    platforms: list[str],
    lock: Path,
    pip_args: list[str] = (),
    sdists: tuple[str, ...] = (),
) -> list[str]:
    """pip_download, building the pure-Python wheel of a named sdist-only package when pip lacks one;
    the wheels built here."""
    built: dict[str, str] = {}
    while True:
        try:
            pip_download(reqs, dest, python, platforms, lock, [*pip_args, "--find-links", str(dest)])
            return sorted(built.values())
        except NoWheel as e:
            if e.name not in map(canonical, sdists) or e.name in built:
                raise
            built[e.name] = pure_wheel(e.name, read_lock(lock), dest).name


def pure_wheel(name: str, pins: dict[str, str], dest: Path) -> Path:
    """The wheel of a pinned sdist, built here: only a py3-none-any one serves every interpreter."""
    if name not in pins:
        raise WheelhouseError(f"{name}: not pinned by requirements.lock, so not built from its sdist")
    before = set(dest.glob("*.whl"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-binary",
            name,
            "--wheel-dir",
            str(dest),
            f"{name}=={pins[name]}",
        ],
        capture_output=True,
        text=True,
    )
    new = sorted(set(dest.glob("*.whl")) - before)
    if r.returncode or not new:
        raise WheelhouseError(
            f"{name}=={pins[name]}: its sdist did not build: {(r.stdout + r.stderr).strip().splitlines()[-1]}"
        )
    if not new[0].name.endswith("-none-any.whl"):
        new[0].unlink()
        raise WheelhouseError(f"{name}=={pins[name]}: its sdist builds {new[0].name}, not a pure-Python wheel")
    return new[0]


def own_wheel(dest: Path) -> Path:
    """draftport's wheel, built from a copy of the sources so the checkout gets no build/ folder."""
    with tempfile.TemporaryDirectory(prefix="draftport-src-") as tmp:
        src = Path(tmp)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy2(ROOT / name, src / name)
        shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), str(src)]
        if has_setuptools():
            cmd.insert(4, "--no-build-isolation")  # offline when this interpreter can build it already
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise WheelhouseError(
                f"draftport: its wheel did not build: {(r.stdout + r.stderr).strip().splitlines()[-1]}"
            )
    return next(dest.glob("draftport-*.whl"))


def has_setuptools() -> bool:
    """A setuptools here that builds wheels by itself (70.1+ has bdist_wheel; pyproject asks >=68)."""
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(x) for x in setuptools.__version__.split(".")[:2]) >= (70, 1)


def wheel_pins(folder: Path) -> dict[str, str]:
    """{canonical name: version} of the wheels in a folder, read from their file names."""
    return {canonical(w.name.split("-")[0]): w.name.split("-")[1] for w in folder.glob("*.whl")}


def unpinned(folder: Path, pins: dict[str, str]) -> list[str]:
    """Wheels the lock does not pin (a dependency of torch's CUDA build, a marker the lock lacks)."""
    return sorted(f"{n}=={v}" for n, v in wheel_pins(folder).items() if n not in pins and n != "draftport")


def build(
    out: Path,
    python: str,
    platforms: list[str],
    wheel_set: str,
    torch: bool,
    lock: Path = ROOT / "requirements.lock",
    pip_args: list[str] = (),
    sdists: tuple[str, ...] = SDISTS,
) -> dict:
    """Download, add draftport's wheel, write the manifest, then rename: no half-built `out`."""
    platforms = expand_platforms(platforms)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        built = fetch(requirements(wheel_set, torch), tmp, python, platforms, lock, pip_args, sdists)
        meta = describe(python, platforms, wheel_set, torch, lock, own_wheel(tmp), tmp)
        manifest = write_manifest(tmp, {**meta, "built_here": built})
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def describe(
    python: str, platforms: list[str], wheel_set: str, torch: bool, lock: Path, wheel: Path, folder: Path
) -> dict:
    """Everything the manifest says besides its files."""
    commit, dirty = git_commit()
    return {
        "python": python,
        "implementation": "cp",
        "platforms": platforms,
        "set": wheel_set,
        "install": install_spec(wheel_set),
        "torch": torch,
        "torch_pin": read_lock(lock).get("torch"),
        "torch_requires": torch_requirement(),
        "draftport": {"version": project()["version"], "wheel": wheel.name, "commit": commit, "dirty": dirty},
        "lock": {"file": lock.name, "sha256": sha256(lock)},
        "unpinned": unpinned(folder, read_lock(lock)),
    }


def publish(tmp: Path, out: Path) -> None:
    """Swap the finished folder in; an older wheelhouse is removed only once the new one is in place."""
    old = out.with_name(f"{out.name}.old-{os.getpid()}")
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)


# ---- the manifest -----------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, meta: dict) -> dict:
    """meta plus every file's name, size and sha256, written as folder/MANIFEST.json."""
    files = [
        {"name": p.name, "size": p.stat().st_size, "sha256": sha256(p)}
        for p in sorted(folder.iterdir())
        if p.name != MANIFEST
    ]
    manifest = {"format": FORMAT, **meta, "files": files, "total_bytes": sum(f["size"] for f in files)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise WheelhouseError(f"{path}: missing: not a wheelhouse (build one with `make wheelhouse`)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise WheelhouseError(f"{path}: not JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise WheelhouseError(f"{path}: format {manifest.get('format')!r}, this tool reads {FORMAT}")
    return manifest


def interpreter(python: str) -> dict:
    """The facts of an interpreter that decide whether the wheels install there."""
    try:
        r = subprocess.run([python, "-c", FACTS], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise WheelhouseError(f"{python}: does not run as a Python interpreter ({e})") from None
    impl, version, plat, machine = r.stdout.split()
    return {"implementation": impl, "version": version, "platform": plat, "machine": machine, "path": python}


def verify(folder: Path, python: str = sys.executable) -> dict:
    """The manifest, once every file matches it and the interpreter is the one it was built for."""
    manifest = read_manifest(folder)
    problems = file_problems(folder, manifest) + interpreter_problems(folder, manifest, interpreter(python))
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise WheelhouseError(problems[0] + more)
    return manifest


def file_problems(folder: Path, manifest: dict) -> list[str]:
    listed = {f["name"]: f for f in manifest["files"]}
    present = {p.name for p in folder.iterdir() if p.name != MANIFEST}
    problems = [f"{folder / n}: missing (listed in {MANIFEST})" for n in sorted(listed.keys() - present)]
    problems += [f"{folder / n}: not listed in {MANIFEST}" for n in sorted(present - listed.keys())]
    for name in sorted(listed.keys() & present):
        size, digest = (folder / name).stat().st_size, sha256(folder / name)
        if size != listed[name]["size"] or digest != listed[name]["sha256"]:
            problems.append(
                f"{folder / name}: sha256 {digest[:16]}… ({size} bytes), {MANIFEST} says "
                f"{listed[name]['sha256'][:16]}… ({listed[name]['size']} bytes)"
            )
    return problems


def interpreter_problems(folder: Path, manifest: dict, facts: dict) -> list[str]:
    where = folder / MANIFEST
    if facts["implementation"] != "cpython":
        return [f"{where}: built for CPython, {facts['path']} is {facts['implementation']}"]
    if facts["version"] != manifest["python"]:
        return [f"{where}: built for Python {manifest['python']}, {facts['path']} is Python {facts['version']}"]
    arch = {m.group(1) for p in manifest["platforms"] if (m := LINUX_TAG.fullmatch(p))}
    if arch and (facts["platform"] != "linux" or facts["machine"] not in arch):
        return [
            f"{where}: built for {'/'.join(sorted(arch))} Linux, {facts['path']} runs on "
            f"{facts['machine']} {facts['platform']}"
        ]
    return []


# ---- installing -------------------------------------------------------------------------------------
def offline_env() -> dict:
    """No PIP_* variable and no pip config file: the wheelhouse is the only source (no mirror, no index)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def torch_requirement() -> str:
    """pyproject's torch requirement, e.g. "torch>=2.9" (what a cluster's own build must satisfy)."""
    return next(r for r in project()["dependencies"] if req_name(r) == "torch")


def _release(version: str) -> tuple[int, ...]:
    """2.11.0+cu130 -> (2, 11, 0): the release part, for a >= comparison."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0].split("rc")[0].split("a")[0])[:3])


def check_torch(python: str, manifest: dict) -> None:
    """The cluster's torch must be there (the wheelhouse carries none by default) and satisfy
    draftport's requirement (its own build: the lock's pin is the Makefile's venvs')."""
    if manifest["torch"]:
        return
    probe = "import importlib.metadata as m; print(m.version('torch'))"
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    want = manifest.get("torch_requires") or f"torch=={manifest['torch_pin']}"
    if r.returncode:
        raise WheelhouseError(
            f"torch: not installed for {python}: install the cluster's CUDA build ({want}) "
            "first (this wheelhouse carries no torch; WHEEL_TORCH=1 builds one that does)"
        )
    found = r.stdout.strip()
    m = re.fullmatch(r"torch\s*(==|>=)\s*([\d.]+)", want.replace(" ", ""))
    if m and (
        (m.group(1) == "==" and _release(found) != _release(m.group(2)))
        or (m.group(1) == ">=" and _release(found) < _release(m.group(2)))
    ):
        raise WheelhouseError(f"torch: {found} installed for {python}, draftport requires {want}")


def target_python(venv: Path | None) -> str:
    """The interpreter to install for: this one, or a venv's (made on first use, seeing the system's torch)."""
    if venv is None:
        return sys.executable
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    return str(venv / "bin" / "python")


def install(folder: Path, venv: Path | None = None, no_deps: bool = False) -> str:
    """Verify, check torch, then pip from the wheelhouse alone; the version of draftport installed."""
    python = target_python(venv)
    manifest = verify(folder, python)
    check_torch(python, manifest)
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--find-links",
        str(folder.resolve()),
        *(["--no-deps"] if no_deps else []),
        manifest["install"],
    ]
    r = subprocess.run(cmd, env=offline_env(), capture_output=True, text=True)
    if r.returncode:
        errors = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("ERROR:")]
        raise WheelhouseError(
            f"{folder}: pip install {manifest['install']} failed: {errors[-1] if errors else r.returncode}"
        )
    probe = "import importlib.metadata as m, draftport; print(m.version('draftport'))"
    return subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, check=True, cwd=tempfile.gettempdir()
    ).stdout.strip()


# ---- command line -----------------------------------------------------------------------------------
def summary(out: Path, manifest: dict) -> str:
    """The size line each build prints (the device machine takes at most 64 MiB a call)."""
    big = sorted(manifest["files"], key=lambda f: -f["size"])[:3]
    torch = "torch included" if manifest["torch"] else "no torch"
    return (
        f"{out}: {manifest['set']} set, {len(manifest['files'])} files, "
        f"{manifest['total_bytes'] / 2**20:.1f} MiB, cp{manifest['python'].replace('.', '')} "
        f"{manifest['platforms'][0]}, {torch}; largest: "
        + ", ".join(f"{f['name']} {f['size'] / 2**20:.1f} MiB" for f in big)
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/wheelhouse.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the pinned binary wheels and write MANIFEST.json")
    b.add_argument("--out", type=Path, default=Path("wheelhouse"))
    b.add_argument("--python-version", default="3.12", help="the cluster's interpreter, X.Y")
    b.add_argument(
        "--platform",
        nargs="+",
        default=["manylinux_2_28_x86_64"],
        help="wheel platform tags; manylinux_2_Y_ARCH takes older glibc's too",
    )
    b.add_argument(
        "--set", choices=sorted(SETS), default="full", help="core: the library's steps; full: the pipeline too"
    )
    b.add_argument("--torch", type=int, choices=(0, 1), default=0, help="1: carry torch (and its CUDA wheels) too")
    b.add_argument(
        "--sdist",
        nargs="*",
        default=list(SDISTS),
        help="sdist-only packages whose pure-Python wheels may be built here (default: %(default)s)",
    )
    b.add_argument("--find-links", action="append", default=[], help="a local folder of wheels to read too")
    b.add_argument("--no-index", action="store_true", help="read the --find-links folders only")
    v = sub.add_parser("verify", help="check every file and the interpreter against MANIFEST.json")
    v.add_argument("wheelhouse", type=Path)
    v.add_argument("--python", default=sys.executable, help="the interpreter it is for (default: this one)")
    i = sub.add_parser("install", help="verify, then pip install from the wheelhouse alone")
    i.add_argument("--wheelhouse", type=Path, default=Path("wheelhouse"))
    i.add_argument("--venv", type=Path, help="install into this venv (made with --system-site-packages if missing)")
    i.add_argument("--no-deps", action="store_true", help="draftport alone, its dependencies already installed")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "build":
            pip_args = [a for d in args.find_links for a in ("--find-links", d)] + ["--no-index"] * args.no_index
            manifest = build(
                args.out,
                args.python_version,
                args.platform,
                args.set,
                bool(args.torch),
                pip_args=pip_args,
                sdists=tuple(args.sdist),
            )
            print(summary(args.out, manifest))
            for line in manifest["unpinned"]:
                print(f"note: {line} is not pinned by requirements.lock")
        elif args.command == "verify":
            manifest = verify(args.wheelhouse, args.python)
            print(f"{args.wheelhouse}: {len(manifest['files'])} files match {MANIFEST}")
        else:
            version = install(args.wheelhouse, args.venv, args.no_deps)
            print(f"draftport {version} installed offline from {args.wheelhouse}")
    except WheelhouseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
