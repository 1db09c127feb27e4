// tk_ops._C: importing it loads the shared library, whose TORCH_LIBRARY_IMPL blocks register the CUDA
// kernels of the tk ops. Its methods are the norms' fast entries (fast_entry.cpp) and what the kernels
// take (kernel_support.h).
#include <Python.h>

#include "fast_entry.h"
#include "kernel_support.h"

namespace {

// {op: {property: (values, ...)}} from the declarations of kernel_support.h.
PyObject* kernel_support(PyObject*, PyObject*) {
  PyObject* ops = PyDict_New();
  if (ops == nullptr) return nullptr;
  for (const auto& [op, properties] : tk::registration::declared_support()) {
    PyObject* declared = PyDict_New();
    if (declared == nullptr || PyDict_SetItemString(ops, op.c_str(), declared) != 0) {
      Py_XDECREF(declared);
      Py_DECREF(ops);
      return nullptr;
    }
    Py_DECREF(declared);  // ops holds it
    for (const auto& [property, values] : properties) {
      PyObject* items = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
      if (items == nullptr) {
        Py_DECREF(ops);
        return nullptr;
      }
      for (size_t i = 0; i < values.size(); ++i) {
        PyObject* value = PyLong_FromLongLong(values[i]);
        if (value == nullptr) {
          Py_DECREF(items);
          Py_DECREF(ops);
          return nullptr;
        }
        PyTuple_SET_ITEM(items, static_cast<Py_ssize_t>(i), value);  // steals the reference
      }
      const int failed = PyDict_SetItemString(declared, property.c_str(), items);
      Py_DECREF(items);
      if (failed != 0) {
        Py_DECREF(ops);
        return nullptr;
      }
    }
  }
  return ops;
}

PyMethodDef methods[] = {
    {"layer_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tk::fast_entry::layer_norm)),
     METH_FASTCALL, "tk_ops.layer_norm's plain calls (x, weight, bias, eps, residual, dropout_p, return_residual); None for others"},
    {"rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&tk::fast_entry::rms_norm)), METH_FASTCALL,
     "tk_ops.rms_norm's plain calls (x, weight, eps, residual, return_residual); None for others"},
    {"kernel_support", &kernel_support, METH_NOARGS,
     "{op: {property: values}}: what each op's kernels take (e.g. {'attention': {'head_dims': (64, 128)}})"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "CUDA kernels of the tk ops (registered on import)", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
