"""Build tk_ops: pure Python everywhere, plus the sm_90a CUDA extension ``tk_ops._C`` when possible.

The extension is built when torch has CUDA and nvcc is found (and TK_OPS_NO_CUDA is not 1). Every
kernel is its own translation unit so ninja compiles them in parallel (MAX_JOBS, default: all
cores); only sm_90a code is generated, which keeps a cold build short. It is compiled against the
installed torch, so the build runs without pip's build isolation (``pip install
--no-build-isolation``). The package's metadata and dependencies are in pyproject.toml.
"""

import glob
import os

from setuptools import find_packages, setup


def cuda_extension_modules():
    if os.environ.get("TK_OPS_NO_CUDA") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        raise SystemExit(
            "tk_ops builds against the installed torch, which this build cannot import: install torch "
            "first, then `pip install --no-build-isolation -e .` (pip's build isolation hides the installed "
            "torch; TK_OPS_NO_CUDA=1 builds the pure-Python package without it)"
        ) from None

    if not torch.version.cuda or cpp_extension.CUDA_HOME is None:
        return [], {}
    root = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(
        os.path.relpath(p, root)
        for p in glob.glob(os.path.join(root, "csrc", "torch", "*.cpp"))
        + glob.glob(os.path.join(root, "csrc", "kernels", "**", "*.cu"), recursive=True)
    )
    if not sources:
        return [], {}
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
    return [extension], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = cuda_extension_modules()

setup(
    packages=find_packages(include=["tk_ops", "tk_ops.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
