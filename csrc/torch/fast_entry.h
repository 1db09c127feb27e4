// The norms' fast entries (fast_entry.cpp): methods of tk_ops._C, called with METH_FASTCALL.
#pragma once

#include <Python.h>

namespace tk::fast_entry {

// tk_ops.layer_norm's arguments (x, weight, bias, eps, residual, dropout_p, return_residual).
PyObject* layer_norm(PyObject* module, PyObject* const* args, Py_ssize_t nargs);
// tk_ops.rms_norm's arguments (x, weight, eps, residual, return_residual).
PyObject* rms_norm(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

}  // namespace tk::fast_entry
