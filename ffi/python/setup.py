"""Builds libkvwire_ffi.so with cargo and puts it in the package.

KVWIRE_CARGO_PROFILE picks the cargo profile (release unless set; `debug`
reuses a workspace's debug build). KVWIRE_FFI_LIB names a library already
built, and skips cargo.
"""

import json
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def cargo_library():
    lib = os.environ.get("KVWIRE_FFI_LIB")
    if lib:
        return lib
    profile = os.environ.get("KVWIRE_CARGO_PROFILE", "release")
    cmd = ["cargo", "build", "-p", "kvwire-ffi"] + (["--release"] if profile == "release" else ["--profile", profile] if profile != "debug" else [])
    subprocess.check_call(cmd, cwd=ROOT)
    target = subprocess.check_output(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT)
    return os.path.join(json.loads(target)["target_directory"], profile, "libkvwire_ffi.so")


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "kvwire")
        os.makedirs(dest, exist_ok=True)
        shutil.copy2(cargo_library(), os.path.join(dest, "libkvwire_ffi.so"))


class PlatformDistribution(Distribution):
    # The wheel carries a native library: not a pure-Python wheel.
    def has_ext_modules(self):
        return True


cmdclass = {"build_py": BuildWithLibrary}
try:
    from wheel.bdist_wheel import bdist_wheel

    class Py3Wheel(bdist_wheel):
        # ctypes, no extension module: any Python 3, this platform.
        def get_tag(self):
            return ("py3", "none", super().get_tag()[2])

    cmdclass["bdist_wheel"] = Py3Wheel
except ImportError:
    pass

setup(cmdclass=cmdclass, distclass=PlatformDistribution)
