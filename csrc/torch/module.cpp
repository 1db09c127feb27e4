// tk_ops._C: importing it loads the shared library, whose TORCH_LIBRARY_IMPL blocks register the CUDA
// kernels of the tk ops. Its methods are the norms' fast entries (fast_entry.cpp).
#include <Python.h>

#include "fast_entry.h"

namespace {

PyMethodDef methods[] = {
    {"layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tk::fast_entry::layer_norm)),
     METH_FASTCALL, "tk_ops.layer_norm's plain calls (x, weight, bias, eps, residual, dropout_p, return_residual); None for others"},
    {"rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tk::fast_entry::rms_norm)), METH_FASTCALL,
     "tk_ops.rms_norm's plain calls (x, weight, eps, residual, return_residual); None for others"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "CUDA kernels of the tk ops (registered on import)", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
