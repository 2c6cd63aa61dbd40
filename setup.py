"""Build of the compiled CPU expert kernels (cpu_kernels/csrc), one shared library per ISA.

Each library is a plain C ABI loaded with ctypes (cpu_kernels/_native.py): no Python or torch headers,
so one build serves every torch version, and ctypes releases the GIL during each call. Every ISA is
compiled with its own flags and chosen at run time from cpuid, so the build never needs the build
machine's CPU to have the ISA. A compiler that lacks an ISA's flags skips that library with a loud
warning instead of failing the install (the runtime then falls back to the next ISA, or to torch).
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

BASE = ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma",
          "-mavx2", "-mf16c"]
AMX = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
CSRC = "cpu_kernels/csrc/"
DEPS = [CSRC + f for f in ("hy.h", "pool.h", "driver.h", "fused.h", "lane.h", "pack.h", "api.h", "kern_avx2.h", "kern_avx512.h", "kern_amx.h",
                                 "kern_iq256.h")]


def lib(name, source, flags):
    return Extension(
        f"cpu_kernels._hy_{name}",
        sources=[CSRC + source],
        depends=DEPS,
        language="c++",
        extra_compile_args=BASE + flags,
        extra_link_args=["-pthread"],
        optional=True,  # setuptools: a failed build of this library warns and continues
    )


BUILDING = "building the CPU kernels (once, ~1 min)..."


def announce_build(line: str = BUILDING) -> None:
    """One line before the compiler runs for a minute. pip keeps a build's own output to itself unless -v, so the
    line also goes to the controlling terminal when there is one and stdout is not it."""
    print(line, flush=True)
    if sys.stdout.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:  # no terminal (CI, a service): the line above is in the build log
        pass


class LoudBuildExt(build_ext):
    """Say when the kernels start building (a minute of compiling), and plainly which ISA library could not be
    built and what that means at run time."""

    def run(self):
        if any(self.stale(ext) for ext in self.extensions):
            announce_build()
        super().run()

    def stale(self, ext) -> bool:
        """Whether build_ext will compile `ext` (setuptools skips a library newer than its sources)."""
        try:
            from setuptools.modified import newer_group
        except ImportError:  # setuptools < 69: say it anyway
            return True
        inplace, self.inplace = self.inplace, 0  # setuptools builds into build_lib, then copies in place
        try:
            target = self.get_ext_fullpath(ext.name)
        finally:
            self.inplace = inplace
        return self.force or newer_group(list(ext.sources) + list(ext.depends), target, "newer")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # compiler lacks the flags, or an old assembler
            print(f"\n*** hybrid-moe: NOT building {ext.name} ({exc}); that ISA will be unavailable and "
                  "cpu_kernels falls back to the next one (see cpu_kernels.available_isas()).\n", flush=True)
            raise


if __name__ == "__main__":  # pip's build backend runs this file as __main__; tests import it for LoudBuildExt
    setup(
        ext_modules=[
            lib("probe", "probe.cpp", []),
            lib("avx2", "lib_avx2.cpp", ["-mavx2", "-mfma", "-mf16c"]),
            lib("avx512", "lib_avx512.cpp", AVX512),
            lib("amx", "lib_amx.cpp", AVX512 + AMX),
            lib("amxemu", "lib_amxemu.cpp", ["-mavx2", "-mfma", "-mf16c"]),  # tests: AMX path with emulated tiles
        ],
        cmdclass={"build_ext": LoudBuildExt},
    )
