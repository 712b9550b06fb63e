"""The wheel installs kernels/, sharding/ and train/ as mtjax.kernels, mtjax.sharding, mtjax.train."""

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAPPED = {"mtjax": "mtjax", "mtjax.kernels": "kernels", "mtjax.sharding": "sharding", "mtjax.train": "train"}


def _source_packages() -> set[str]:
    """Every folder with an __init__.py under the mapped roots, as an mtjax.* package name."""
    found = set()
    for package, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([package, *rel.parts]) if rel.parts else package)
    return found


def test_every_source_package_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == MAPPED
    assert _source_packages() == set(config["packages"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    try:
        import setuptools  # noqa: F401
    except ImportError:
        pytest.skip("setuptools is not installed (it comes with the test extra)")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", *MAPPED.values()):
        path = ROOT / name
        (shutil.copytree if path.is_dir() else shutil.copy)(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True)
    return next(out.glob("mtjax-*.whl"))


def test_wheel_contains_the_four_packages_and_no_top_level_kernels_or_train(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for package in MAPPED:
        assert f"{package.replace('.', '/')}/__init__.py" in names
    tops = {n.split("/")[0] for n in names}
    assert not tops & {"kernels", "sharding", "train", "tests"}
    assert "mtjax/kernels/cuda/cublaslt_gemm.cc" in names  # compiled where it runs
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "mtjax = mtjax.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_imports(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True)
    code = "import mtjax, mtjax.kernels, mtjax.sharding, mtjax.train; print(mtjax.kernels.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr
    assert str(target) in result.stdout
