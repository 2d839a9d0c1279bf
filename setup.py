"""Build of torch_lowbit: Python packages plus the csrc/ C++ extension (torch_lowbit._C).

One build runs on any x86-64 (or aarch64): ISA-specific kernels carry per-function `target` attributes
(or a per-file target pragma) and are chosen at run time from CPU features (see csrc/common/dispatch.h),
so no global -march is used.

TORCH_LOWBIT_BUILD_EXT=0 installs without the extension (no C++ compiler needed): CUDA runs the Triton
kernels, CPU ops run pure-torch references (docs/install.md).
"""
import glob
import os
import platform

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))

sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-Wall", "-Wno-unused-function"]
if platform.machine() in ("x86_64", "AMD64"):
    cxx_flags.append("-DTORCH_LOWBIT_X86=1")
elif platform.machine() in ("aarch64", "arm64"):
    # scalar paths stay bit-exact with x86's (whose baseline has no FMA to contract into); the
    # dotprod kernel's file carries its own target pragma, chosen at run time from HWCAP
    cxx_flags.append("-ffp-contract=off")

BUILD_EXT_ENV = "TORCH_LOWBIT_BUILD_EXT"
build_ext_flag = os.environ.get(BUILD_EXT_ENV, "1").strip().lower()
if build_ext_flag not in ("0", "1", "false", "true", "no", "yes", ""):
    raise SystemExit(f"{BUILD_EXT_ENV}={build_ext_flag!r}: use 1 (build the C++ extension, the default) or 0 (skip it)")
BUILD_EXT = build_ext_flag not in ("0", "false", "no")

packages = [p for p in find_packages(include=["torch_lowbit", "torch_lowbit.*"])]
packages.append("torch_lowbit.triton_kernels")

setup(
    packages=packages,
    # triton_kernels/ sits at the repo top but installs as torch_lowbit.triton_kernels: a top-level
    # `triton_kernels` module would collide with the PyPI package of that name.
    package_dir={"torch_lowbit": "torch_lowbit", "torch_lowbit.triton_kernels": "triton_kernels"},
    package_data={"torch_lowbit": ["eval/tasks/*.yaml", "formats/data/*.safetensors"]},
    ext_modules=[
        CppExtension(
            "torch_lowbit._C",
            sources=sources,
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=["-fopenmp"],
        )
    ] if BUILD_EXT else [],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)} if BUILD_EXT else {},
)
