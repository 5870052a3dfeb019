"""The distribution installs as `headway` (never as bare `train`/`inference`), editable and as a wheel."""

import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = (
    "import headway, headway.heads, headway.train, headway.inference, headway.configs, pathlib, importlib.util;"
    "from headway.heads import MedusaHeads, MedusaConfig, load_drafter;"
    "from headway.train.medusa import MedusaRunConfig;"
    "assert importlib.util.find_spec('train') is None and importlib.util.find_spec('inference') is None;"
    "assert (headway.configs.CONFIG_DIR / 'medusa' / 'tiny.yaml').is_file();"
    "print(pathlib.Path(headway.heads.__file__).resolve())"
)


def test_editable_install_imports_from_the_tree(tmp_path):
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == ROOT / "heads" / "__init__.py"


def test_wheel_installs_into_a_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-w", str(dist), "-q"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (wheel,) = dist.glob("headway-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "headway/heads/medusa.py" in names and "headway/configs/medusa/tiny.yaml" in names
    assert not any(n.startswith(("train/", "inference/", "heads/", "tests/")) for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    # Dependencies (torch, transformers, ...) come from this environment's site-packages, appended
    # after the fresh venv's own, so `headway` itself can only come from the wheel.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    out = subprocess.run([str(py), "-c", CHECK], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(env_dir)
