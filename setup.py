"""Build tk_ops: pure Python everywhere, plus the sm_90a CUDA extension ``tk_ops._C`` when possible.

The extension is built when torch has CUDA and nvcc is found (and TK_OPS_NO_CUDA is not 1). Every
kernel is its own translation unit so ninja compiles them in parallel (MAX_JOBS, default: all
cores); only sm_90a code is generated, which keeps a cold build short. It is compiled against the
installed torch, so the build runs without pip's build isolation (``pip install
--no-build-isolation``). The package's metadata and dependencies are in pyproject.toml.

What it decided is recorded in ``tk_ops/_build_info.py`` (generated, git-ignored), written by the
egg_info, build_py and build_ext commands, so every way of building writes it where tk_ops is
imported from (``pip install -e .``, ``pip install .``, ``python setup.py build_ext --inplace``):
``tk_ops.extension_status()`` reads it to say why the extension is not there.
"""

import glob
import os

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD_INFO = os.path.join(ROOT, "tk_ops", "_build_info.py")


def torch_version():
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def cuda_extension_modules():
    """(ext_modules, build_ext command, why not): the extension to build, or none and the reason."""
    if os.environ.get("TK_OPS_NO_CUDA") == "1":
        return [], build_ext, "TK_OPS_NO_CUDA=1 was set"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        raise SystemExit(
            "tk_ops builds against the installed torch, which this build cannot import: install torch "
            "first, then `pip install --no-build-isolation -e .` (pip's build isolation hides the installed "
            "torch; TK_OPS_NO_CUDA=1 builds the pure-Python package without it)"
        ) from None

    if not torch.version.cuda:
        return [], build_ext, f"torch {torch.__version__} has no CUDA"
    if cpp_extension.CUDA_HOME is None:
        # where torch's cpp_extension looks for the toolkit
        return [], build_ext, "nvcc not found (CUDA_HOME and CUDA_PATH unset, no nvcc on PATH, no /usr/local/cuda)"
    root = ROOT
    sources = sorted(
        os.path.relpath(p, root)
        for p in glob.glob(os.path.join(root, "csrc", "torch", "*.cpp"))
        + glob.glob(os.path.join(root, "csrc", "kernels", "**", "*.cu"), recursive=True)
    )
    if not sources:
        return [], build_ext, "no kernel sources under csrc/"
    include_dirs = [os.path.join(root, "csrc")]
    common = ["-O3", "-std=c++20", "-DNDEBUG"]
    nvcc = common + [
        "-gencode=arch=compute_90a,code=sm_90a",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        "-Xptxas=--warn-on-spills",
        # the tile core uses the bf16/half operators that torch's default flags switch off
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
    ]
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    extension = cpp_extension.CUDAExtension(
        name="tk_ops._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": common, "nvcc": nvcc},
    )
    return [extension], cpp_extension.BuildExtension.with_options(use_ninja=True), ""


def build_info(reason):
    """The text of tk_ops/_build_info.py for the decision ``reason`` ("" when the extension is built)."""
    return (
        "# Written by setup.py (git-ignored): what the build decided about the CUDA extension tk_ops._C,\n"
        "# read by tk_ops.extension_status().\n"
        f"TORCH = {torch_version()!r}  # the torch it was built against\n"
        f"BUILDS_EXTENSION = {not reason!r}  # setup.py compiles tk_ops._C\n"
        f"REASON = {reason!r}  # why not, when not built\n"
    )


def write_build_info(reason):
    text = build_info(reason)
    try:
        with open(BUILD_INFO) as f:
            if f.read() == text:
                return
    except OSError:
        pass
    try:
        with open(BUILD_INFO, "w") as f:
            f.write(text)
    except OSError as error:  # a read-only tree: extension_status() then says there is no record
        print(f"tk_ops: could not write {BUILD_INFO} ({error})")


def recording(name, command):
    """The command ``name``: ``command``, which first writes tk_ops/_build_info.py."""

    def run(self):
        write_build_info(why_not)
        command.run(self)

    return type(name, (command,), {"run": run})


ext_modules, build_ext_command, why_not = cuda_extension_modules()

setup(
    packages=find_packages(include=["tk_ops", "tk_ops.*"]),
    ext_modules=ext_modules,
    cmdclass={
        "egg_info": recording("egg_info", egg_info),
        "build_py": recording("build_py", build_py),
        "build_ext": recording("build_ext", build_ext_command),
    },
)
