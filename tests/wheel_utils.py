"""Build headway's wheel and install it into a fresh venv (the packaging and CLI tests share this)."""

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def install_wheel(base: Path) -> tuple[Path, Path]:
    """(wheel, venv folder): the wheel built from this tree without its dependencies, installed into a
    new venv whose other imports (torch, transformers, ...) come from this environment's site-packages,
    appended after the venv's own, so `headway` itself can only come from the wheel."""
    dist = base / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                          "-w", str(dist), "-q"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    (wheel,) = dist.glob("headway-*.whl")
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return wheel, env_dir
