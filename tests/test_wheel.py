"""The wheel works outside the source checkout: built from it (``pip wheel``, no download), installed
in a fresh venv, run from a folder outside the checkout, ``cutefa --version`` and ``cutefa list``
work and ``cutefa compile`` builds a kernel into a pack, rendering its module from the packaged
templates into the cache dir and writing nothing into the installed package. The kernel is the one
a checkout builds (same fingerprint), so packs from either serve both.

The fresh venv takes the dependencies (torch, the CuTe DSL) from this venv's site-packages (a
``.pth`` that adds it as a site dir, so nothing is downloaded); the test checks that ``cutefa``
itself is imported from the wheel. Slow (minutes: one kernel compile), so marked ``slow`` and
``compile``: CI's full run takes it, the fast run (``-m "not compile and not gpu"``) does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from cutefa import __version__
from cutefa import compile as cc
from cutefa.model.spec import parse_name

pytestmark = [pytest.mark.slow, pytest.mark.compile]

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "cutefa_sm80_fwd_fp16_hd64_128x64_s1_w4"  # a small committed variant
TARGET = "sm_80"


def run(cmd: list, cwd: Path, env: dict[str, str], timeout: int = 1200) -> str:
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (
        f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_the_wheel_installs_and_compiles_outside_the_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUTEFA_", "PYTHON", "CUTE_DSL"))}
    env["CUTEFA_CACHE_DIR"] = str(tmp_path / "cache")
    work = tmp_path / "work"  # the folder the commands run in, outside the checkout
    work.mkdir()

    wheels = tmp_path / "wheels"
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT],
        work,
        env,
    )
    (wheel,) = wheels.glob("cutefa-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    templates = [n for n in names if n.startswith("cutefa/templates/") and n.endswith(".py.j2")]
    assert len(templates) >= 5, f"the wheel has no kernel templates: {sorted(names)[:20]}"
    assert any(n.startswith("cutefa/tuned/") and n.endswith(".json") for n in names)
    assert not any(n.startswith(("generated/", "tests/", "tools/")) for n in names)

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], work, env)
    python = venv / "bin" / "python"
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
        work,
        env,
    )
    site = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, env).strip()
    )
    deps = sysconfig.get_paths()["purelib"]  # this venv's: torch, the DSL and the rest
    (site / "_cutefa_test_deps.pth").write_text(f"import site; site.addsitedir({deps!r})\n")
    installed = site / "cutefa"
    where = run([python, "-c", "import cutefa; print(cutefa.__file__)"], work, env).strip()
    assert Path(where).resolve().is_relative_to(installed.resolve()), where
    before = files_under(installed)

    cutefa = venv / "bin" / "cutefa"
    assert run([cutefa, "--version"], work, env).strip() == f"cutefa {__version__}"
    listing = run([cutefa, "list", "--arch", "sm80"], work, env)
    assert KERNEL in listing

    pack = tmp_path / "pack"
    run(
        [cutefa, "compile", "--target", TARGET, "--kernels", KERNEL, "--pack", pack, "--jobs", "1"], work, env
    )
    manifest = json.loads((pack / "manifest.json").read_text())
    assert manifest["target"] == TARGET and set(manifest["kernels"]) == {KERNEL}
    record = manifest["kernels"][KERNEL]
    assert (pack / record["file"]).stat().st_size > 0
    assert record["fingerprint"] == cc.fingerprint(parse_name(KERNEL), TARGET)  # the checkout's kernel
    rendered = list((tmp_path / "cache" / "sources").rglob(f"{KERNEL}.py"))
    assert len(rendered) == 1  # rendered from the packaged templates into the cache dir
    assert files_under(installed) == before  # nothing written into the installed package
