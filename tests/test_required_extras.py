"""With DEAR_REQUIRE_EXTRAS=1 (CI), a test skipped because an optional package is missing fails;
without it, it is skipped as before; a GPU-only extra (nccl4py) stays a skip either way. The
suite's own skips for a missing mpirun, Lightning or Horovod are among those that fail."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import missing_extra
from tests.horovod_launch import NO_HOROVOD
from tests.subprocesses import NO_MPIRUN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = '''
import pytest

def test_needs_a_missing_package():
    pytest.importorskip("dear_no_such_package")

def test_needs_nccl4py():
    pytest.importorskip("nccl.core", reason="nccl4py not installed (pip install 'dear[nccl]')")

def test_skipped_for_another_reason():
    pytest.skip("needs a CUDA GPU")

def test_needs_mpirun():
    from tests.subprocesses import NO_MPIRUN
    pytest.skip(NO_MPIRUN)

def test_needs_horovod():
    from tests.horovod_launch import NO_HOROVOD
    pytest.skip(NO_HOROVOD)
'''
MODULE_LEVEL = ('import pytest\npytest.importorskip("dear_no_such_package")\n\n'
                'def test_x():\n    pass\n')


def _run(tmp_path, source: str, require: bool) -> subprocess.CompletedProcess:
    path = tmp_path / "test_sample.py"
    path.write_text(source)
    env = {**os.environ, "PYTHONPATH": ROOT, "DEAR_REQUIRE_EXTRAS": "1" if require else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider",
                           "-p", "tests.conftest", "--rootdir", str(tmp_path), str(path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_reasons() -> None:
    assert missing_extra("could not import 'lightning': No module named 'lightning'")
    assert missing_extra("Horovod is not installed")
    assert missing_extra(NO_MPIRUN) and missing_extra(NO_HOROVOD)
    assert not missing_extra("nccl4py not installed (pip install 'dear[nccl]')")
    assert not missing_extra("needs a CUDA GPU")


def test_a_missing_package_fails_only_where_extras_are_required(tmp_path) -> None:
    got = _run(tmp_path, SAMPLE, require=True)
    assert "3 failed, 2 skipped" in got.stdout, got.stdout + got.stderr
    for name in ("test_needs_a_missing_package", "test_needs_mpirun", "test_needs_horovod"):
        assert f"FAILED test_sample.py::{name}" in got.stdout, got.stdout
    got = _run(tmp_path, SAMPLE, require=False)
    assert "5 skipped" in got.stdout and got.returncode == 0, got.stdout + got.stderr


def test_a_module_skipped_at_import_fails_where_extras_are_required(tmp_path) -> None:
    got = _run(tmp_path, MODULE_LEVEL, require=True)      # 5: nothing collected, not a failure
    assert got.returncode not in (0, 5) and "dear_no_such_package" in got.stdout, \
        got.stdout + got.stderr
    got = _run(tmp_path, MODULE_LEVEL, require=False)
    assert got.returncode == 5 and "1 skipped" in got.stdout, got.stdout + got.stderr
