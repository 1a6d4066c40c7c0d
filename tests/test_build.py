"""Build-level checks: the C core under sanitizers, the generated wrapper, and installs.

- The C core is compiled with a threaded stress driver (csrc/stress_counters.c) under
  ThreadSanitizer and under AddressSanitizer+UBSan, when the compiler supports them.
- The cffi wrapper is preprocessed to prove the GIL is not released around the calls.
- ``pip install .`` into a fresh venv: with ``CC=false`` it must still succeed (pure table);
  with a compiler it must build the extension (atomic table); with
  ``EFFECTFENCE_REQUIRE_EXTENSION=1`` and no compiler it must fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"


def _compiles(tmp_path: Path, flags: list[str]) -> bool:
    probe = tmp_path / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    exe = tmp_path / "probe"
    try:
        built = subprocess.run([CC, *flags, str(probe), "-o", str(exe)], capture_output=True)
        return built.returncode == 0 and subprocess.run([str(exe)]).returncode == 0
    except OSError:
        return False


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_stress_driver_under_sanitizer(tmp_path: Path, sanitizer: str) -> None:
    flags = [f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-g", "-O1", "-pthread"]
    if not _compiles(tmp_path, flags):
        pytest.skip(f"{CC} cannot build and run -fsanitize={sanitizer} programs here")
    exe = tmp_path / "stress"
    build = subprocess.run(
        [
            CC,
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            *flags,
            f"-I{CSRC}",
            str(CSRC / "effectfence_counters.c"),
            str(CSRC / "stress_counters.c"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stderr
    env = dict(os.environ)
    # halt_on_error: any report is a failure, not just a log line.
    env["TSAN_OPTIONS"] = "halt_on_error=1"
    env["ASAN_OPTIONS"] = "halt_on_error=1:detect_leaks=1"
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    run = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "stress: ok" in run.stdout
    assert "WARNING" not in run.stderr and "runtime error" not in run.stderr, run.stderr


def test_generated_wrappers_keep_the_gil(tmp_path: Path) -> None:
    """Preprocess the cffi output: no wrapper may call PyEval_SaveThread (release the GIL), and
    every int argument is converted by the shim's converter."""
    sys.path.insert(0, str(ROOT))
    try:
        import build_ffi
    finally:
        sys.path.remove(str(ROOT))
    source = tmp_path / "wrapper.c"
    build_ffi.ffi.emit_c_code(str(source))
    include = sysconfig.get_paths()["include"]
    pre = subprocess.run(
        [CC, "-E", "-P", f"-I{include}", f"-I{CSRC}", str(source)],
        capture_output=True,
        text=True,
    )
    if pre.returncode != 0:
        pytest.skip(f"cannot preprocess the wrapper: {pre.stderr[:300]}")
    bodies = re.findall(
        r"_cffi_f_(ef\w+)\(PyObject \*self[^)]*\)\s*\{(.*?)\n\}", pre.stdout, flags=re.S
    )
    names = {name for name, _ in bodies}
    assert {"efpy_reserve", "efpy_advance_if", "efpy_compare_exchange", "ef_gil_held"} <= names
    for name, body in bodies:
        assert "PyEval_SaveThread" not in body, f"{name} releases the GIL"
        if name.startswith("efpy_"):
            # The shim raises by setting an exception; the wrapper must then return NULL.
            after_call = body.split(f"result = {name}(", 1)[1].split("pyresult =", 1)[0]
            assert "if (PyErr_Occurred() !=" in after_call and "return" in after_call, name
            # Every argument goes through the shim's clamping converter, not cffi's own (which
            # raises OverflowError for an int outside int64 before the shim can name it).
            for arg in re.findall(r"\b(arg\d)\b", body):
                assert f"efpy_to_int64({arg})" in body, (name, arg)


# --- installs into a fresh virtual environment ------------------------------------------------


def _copy_tree(dest: Path) -> Path:
    """A clean copy of what a source install needs, without any in-place build products."""
    src = dest / "src"
    ignore = shutil.ignore_patterns(
        "*.so", "*.o", "_effectfence_atomic.c", "__pycache__", "*.egg-info", "build"
    )
    for name in ("pyproject.toml", "setup.py", "build_ffi.py", "README.md"):
        if (ROOT / name).exists():
            src.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "csrc", src / "csrc", ignore=ignore)
    shutil.copytree(ROOT / "effectfence", src / "effectfence", ignore=ignore)
    return src


def _fresh_venv(where: Path) -> Path:
    """A venv that sees this interpreter's build tools (setuptools, cffi, pip) but not our
    package: a plain path entry, so the dev env's .pth files (editable installs) don't run."""
    venv.EnvBuilder(with_pip=False).create(where)
    py = where / "bin" / "python"
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dev_site = sysconfig.get_paths()["purelib"]
    Path(site, "zz_dev_tools.pth").write_text(dev_site + "\n")
    return py


def _child_env() -> dict[str, str]:
    """The environment of a process run in the fresh venv: none of our settings, and no
    PYTHONPATH (one naming the source tree, as a run from a checkout sets it, made the
    venv import the tree, not the install)."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("EFFECTFENCE_") and k not in ("PYTHONPATH", "PYTHONHOME")
    }


def _install(
    tmp_path: Path, env_extra: dict[str, str]
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    src = _copy_tree(tmp_path)
    py = _fresh_venv(tmp_path / "venv")
    env = _child_env()
    env.update(env_extra)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q", str(src)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    return py, result


def _backend(py: Path, cwd: Path) -> str:
    """The installed counter backend; also checks that the C accelerator came with the
    atomic table (built and used by a default fence) or stayed away with the pure one."""
    env = _child_env()
    r = subprocess.run(
        [
            str(py),
            "-c",
            "import effectfence.counters as c; t = c.new_table(); t.reserve('x');"
            "import effectfence as e; from effectfence import _accel as a; f = e.EffectFence();"
            "adm = f.request('i', 'd', 't', {'a': 1.5}); assert f.commit(adm.ticket, 2).verify();"
            "print(c.BACKEND, a.speedups is not None, c.__file__)",
        ],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    backend, speedups, path = r.stdout.split()
    assert str(ROOT) not in path, "imported the source tree, not the install"
    assert (Path(path).parent / "py.typed").is_file(), "PEP 561 marker missing from the install"
    compiled = "True" if backend == "atomic" else "False"
    assert speedups == compiled, r.stdout
    return backend


@pytest.mark.slow
def test_install_without_compiler_falls_back_to_pure(tmp_path: Path) -> None:
    py, result = _install(tmp_path, {"CC": "false"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert _backend(py, tmp_path) == "pure"


@pytest.mark.slow
def test_install_requiring_extension_without_compiler_fails(tmp_path: Path) -> None:
    _, result = _install(tmp_path, {"CC": "false", "EFFECTFENCE_REQUIRE_EXTENSION": "1"})
    assert result.returncode != 0


@pytest.mark.slow
def test_install_with_compiler_builds_atomic(tmp_path: Path) -> None:
    py, result = _install(tmp_path, {"EFFECTFENCE_REQUIRE_EXTENSION": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert _backend(py, tmp_path) == "atomic"
