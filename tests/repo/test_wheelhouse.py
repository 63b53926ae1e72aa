"""The wheelhouse for air-gapped nodes (tools/wheelhouse.py, `make wheelhouse`, `make install-offline`).

No network: a small wheelhouse is built for this interpreter by the tool's own `build`, whose
requirement list is swapped for a hand-made pure-Python wheel served from a local folder
(`pip download --no-index --find-links`); draftport's own wheel is built for real. Then its
manifest is checked, tampered with (a flipped byte, a missing file, an extra one, another Python),
and installed offline into fresh venvs.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "wheelhouse.py"
_spec = importlib.util.spec_from_file_location("wheelhouse_tool", TOOL)
W = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(W)

PY = "%d.%d" % sys.version_info[:2]
PLATFORM = f"manylinux_2_28_{platform.machine()}"
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the wheelhouse targets Linux nodes")


def tiny_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal valid pure-Python wheel (module, METADATA, WHEEL, RECORD), made without a build."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test_wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join([*record, f"{dist}/RECORD,,"]) + "\n"
    out = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> Path:
    """A local 'index': dp_probe 1.0 and 2.0 as wheels (the lock below pins 1.0)."""
    folder = tmp_path_factory.mktemp("index")
    tiny_wheel(folder, "dp_probe", "1.0")
    tiny_wheel(folder, "dp_probe", "2.0")
    return folder


@pytest.fixture(scope="module")
def lock(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("lock") / "requirements.lock"
    path.write_text((ROOT / "requirements.lock").read_text() + "dp-probe==1.0\n")
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, index, lock) -> tuple[Path, dict]:
    """A wheelhouse built by the tool for this interpreter: dp_probe from `index`, draftport's own wheel."""
    out = tmp_path_factory.mktemp("built") / "wheelhouse"
    out.mkdir()
    (out / "stale.whl").write_text("left by an older build")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(W, "requirements", lambda wheel_set, torch: ["dp-probe"])
        manifest = W.build(
            out, PY, [PLATFORM], "core", False, lock=lock, pip_args=["--no-index", "--find-links", str(index)]
        )
    return out, manifest


@pytest.fixture
def house(built, tmp_path) -> Path:
    """A copy of the built wheelhouse that a test may damage."""
    return Path(shutil.copytree(built[0], tmp_path / "wheelhouse"))


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    """The tool's refusal: exit 1, a single stderr line naming every word."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith("error: "), r.stderr
    for word in words:
        assert word in line, (word, line)
    return line


# ---- build and manifest ------------------------------------------------------------------------------
def test_build_holds_the_pinned_wheel_and_draftport_and_replaces_the_old_folder(built):
    out, manifest = built
    names = sorted(p.name for p in out.iterdir())
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert names == sorted(
        ["MANIFEST.json", "dp_probe-1.0-py3-none-any.whl", f"draftport-{version}-py3-none-any.whl"]
    )  # the lock's 1.0, not the newer 2.0
    assert not list(out.parent.glob("wheelhouse.*")), "a temp or old folder was left beside the wheelhouse"


def test_manifest_lists_every_file_with_size_and_sha256(built, lock):
    out, manifest = built
    assert json.loads((out / "MANIFEST.json").read_text()) == manifest
    listed = {f["name"]: f for f in manifest["files"]}
    assert set(listed) == {p.name for p in out.iterdir()} - {"MANIFEST.json"}
    for name, entry in listed.items():
        data = (out / name).read_bytes()
        assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest(), name
    assert manifest["total_bytes"] == sum(f["size"] for f in manifest["files"])


def test_manifest_records_target_set_version_commit_and_lock(built, lock):
    _, m = built
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (m["python"], m["implementation"], m["set"], m["install"], m["torch"]) == (
        PY,
        "cp",
        "core",
        "draftport[report]",
        False,
    )
    assert m["platforms"][0] == PLATFORM and f"manylinux2014_{platform.machine()}" in m["platforms"]
    assert m["draftport"]["version"] == project["version"]
    assert m["draftport"]["commit"] is None or len(m["draftport"]["commit"]) == 40
    assert m["lock"] == {"file": "requirements.lock", "sha256": hashlib.sha256(lock.read_bytes()).hexdigest()}
    assert m["torch_pin"] == W.read_lock(ROOT / "requirements.lock")["torch"]
    assert m["unpinned"] == [] and m["built_here"] == []


def test_sets_leave_torch_out_unless_asked():
    core, full = W.requirements("core", False), W.requirements("full", False)
    assert "torch" not in {W.req_name(r) for r in full}
    assert "torch" in {W.req_name(r) for r in W.requirements("core", True)}
    assert {"transformers", "safetensors", "pydantic", "typer"} <= {W.req_name(r) for r in core}
    assert not {"snakemake", "dvc", "mlflow"} & {W.req_name(r) for r in core}
    assert {"snakemake", "dvc", "mlflow"} <= {W.req_name(r) for r in full}
    assert (W.install_spec("core"), W.install_spec("full")) == ("draftport[report]", "draftport[pipeline]")
    assert "matplotlib" in {W.req_name(r) for r in core}  # the report step runs from the core set too


def test_platform_expands_to_older_glibc_tags():
    tags = W.expand_platforms(["manylinux_2_28_x86_64"])
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux1_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and W.expand_platforms(["win_amd64"]) == ["win_amd64"]


def test_a_package_without_a_binary_wheel_fails_naming_it(tmp_path, lock):
    """Only an sdist on the index: one line naming the package, and no wheelhouse folder left."""
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "dp-probe-1.0.tar.gz").write_bytes(b"an sdist pip must not pick")
    out = tmp_path / "wheelhouse"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(W, "requirements", lambda wheel_set, torch: ["dp-probe"])
        with pytest.raises(W.NoWheel) as e:
            W.build(
                out,
                "3.12",
                ["manylinux_2_28_x86_64"],
                "core",
                False,
                lock=lock,
                sdists=(),
                pip_args=["--no-index", "--find-links", str(tmp_path / "index")],
            )
    assert e.value.name == "dp-probe" and "\n" not in str(e.value) and "no binary wheel" in str(e.value)
    assert "cp312" in str(e.value), str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index"], "a half-built wheelhouse was left"


# ---- verification -----------------------------------------------------------------------------------
def test_verification_passes(house):
    assert W.verify(house)["set"] == "core"
    r = run_tool("verify", str(house))
    assert r.returncode == 0 and "files match MANIFEST.json" in r.stdout, r.stderr


def test_a_flipped_byte_fails_naming_the_file(house):
    wheel = house / "dp_probe-1.0-py3-none-any.whl"
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 0x01
    wheel.write_bytes(bytes(data))
    one_line_error(run_tool("verify", str(house)), str(wheel), "sha256")


def test_a_missing_file_fails_naming_it(house):
    (house / "dp_probe-1.0-py3-none-any.whl").unlink()
    one_line_error(run_tool("verify", str(house)), "dp_probe-1.0-py3-none-any.whl", "missing")


def test_an_extra_file_fails_naming_it(house):
    tiny_wheel(house, "dp_intruder", "1.0")
    one_line_error(run_tool("verify", str(house)), "dp_intruder-1.0-py3-none-any.whl", "not listed")


def test_another_python_version_fails(house):
    manifest = json.loads((house / "MANIFEST.json").read_text())
    manifest["python"] = "3.99"
    (house / "MANIFEST.json").write_text(json.dumps(manifest))
    one_line_error(run_tool("verify", str(house)), "MANIFEST.json", "Python 3.99", f"Python {PY}")


def test_no_manifest_fails(house):
    (house / "MANIFEST.json").unlink()
    one_line_error(run_tool("verify", str(house)), "MANIFEST.json", "not a wheelhouse")


# ---- installing ---------------------------------------------------------------------------------------
def venv(path: Path, *options: str) -> Path:
    subprocess.run([sys.executable, "-m", "venv", *options, str(path)], check=True, timeout=300)
    return path


def site_packages(env: Path) -> Path:
    return next(env.glob("lib/python*/site-packages"))


def test_torch_must_satisfy_the_requirement_cuda_label_or_not():
    """The cluster's torch carries a local label (+cu130) and may be another release than the lock's
    pin: draftport's requirement (pyproject, `torch>=2.9`) is what counts."""
    found = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert W.torch_requirement() == "torch>=2.9"
    W.check_torch(sys.executable, {"torch": False, "torch_pin": "0.0.1", "torch_requires": "torch>=2.9"})
    W.check_torch(
        sys.executable, {"torch": False, "torch_pin": None, "torch_requires": f"torch=={found.split('+')[0]}"}
    )
    with pytest.raises(W.WheelhouseError, match=r"torch: .* installed for .*, draftport requires torch>=99\.0"):
        W.check_torch(sys.executable, {"torch": False, "torch_pin": None, "torch_requires": "torch>=99.0"})
    with pytest.raises(W.WheelhouseError, match=r"draftport requires torch==0\.0\.1"):
        W.check_torch(sys.executable, {"torch": False, "torch_pin": "0.0.1"})  # an older manifest: the pin
    assert W._release("2.11.0+cu130") == (2, 11, 0) < W._release("2.13.0") and W._release("2.9") >= (2, 9)


def test_install_refuses_without_torch_and_installs_nothing(house, tmp_path):
    env = venv(tmp_path / "venv", "--without-pip")  # no system site: torch is surely absent
    one_line_error(run_tool("install", "--wheelhouse", str(house), "--venv", str(env)), "torch", "not installed")
    assert not list(site_packages(env).glob("draftport*"))


def test_install_refuses_a_damaged_wheelhouse_and_installs_nothing(house, tmp_path):
    (house / "dp_probe-1.0-py3-none-any.whl").write_bytes(b"truncated")
    env = venv(tmp_path / "venv", "--without-pip")
    one_line_error(run_tool("install", "--wheelhouse", str(house), "--venv", str(env)), "dp_probe-1.0", "sha256")
    assert not list(site_packages(env).glob("draftport*"))


def test_offline_install_into_a_fresh_venv(house, tmp_path):
    """The venv sees torch as a node's would (its metadata through a .pth); the install reads the
    wheelhouse alone: draftport's dependencies are not in it, so only --no-deps succeeds."""
    env = venv(tmp_path / "venv", "--system-site-packages")
    site = Path(importlib.metadata.distribution("torch").locate_file(""))
    torch_meta = next(site.glob("torch-*.dist-info"))
    outer = tmp_path / "node-site"
    outer.mkdir()
    (outer / torch_meta.name).symlink_to(torch_meta)
    (site_packages(env) / "node_torch.pth").write_text(f"{outer}\n")

    one_line_error(
        run_tool("install", "--wheelhouse", str(house), "--venv", str(env)), "pip install draftport[report] failed"
    )  # transformers & co. are on no index it may read
    assert not list(site_packages(env).glob("draftport*"))

    r = run_tool("install", "--wheelhouse", str(house), "--venv", str(env), "--no-deps")
    assert r.returncode == 0 and "installed offline" in r.stdout, r.stdout + r.stderr
    where = subprocess.run(
        [str(env / "bin" / "python"), "-c", "import draftport; print(draftport.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(where).is_relative_to(site_packages(env)), where
    assert (env / "bin" / "draftport").exists()
