"""The distribution installs as `headway` (never as bare `train`/`inference`), editable and as a wheel."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.wheel_utils import install_wheel

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


@pytest.mark.slow  # builds the wheel
def test_wheel_installs_into_a_fresh_venv(tmp_path):
    wheel, env_dir = install_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "headway/heads/medusa.py" in names and "headway/configs/medusa/tiny.yaml" in names
    assert {"headway/heads/formats/eagle.py", "headway/heads/hub/card.py", "headway/heads/target/tiny.py",
            "headway/train/feature_reader.py", "headway/bench/benchmark.py"} <= set(names)  # every subpackage ships
    assert not any(n.startswith(("train/", "inference/", "heads/", "tests/")) for n in names)
    py = env_dir / "bin" / "python"
    out = subprocess.run([str(py), "-c", CHECK], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(env_dir)
