"""Compiling Triton kernels for a GPU target on a machine without one (tests of the CUDA path's build: register
spills, the PTX instructions chosen). The script runs in a subprocess without TRITON_INTERPRET (conftest sets it
in this process), with USAGE's `usage(kernel) -> (local bytes, registers)` prepended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

USAGE = r"""
import os, re, subprocess, tempfile
import triton

def usage(k):
    dump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        use = subprocess.run([dump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"LOCAL:(\d+)", use).group(1)), int(re.search(r"REG:(\d+)", use).group(1))
"""


def compile_script(script: str, tmp_path, tool: str = "cuobjdump") -> list[str]:
    """Run USAGE + script compiled (not interpreted) in a subprocess -> its stdout lines; skips where this Triton
    build ships no NVIDIA `tool`, fails with the subprocess's stderr."""
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool).exists():
        pytest.skip(f"this Triton build ships no NVIDIA tools ({tool})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", USAGE + script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()
