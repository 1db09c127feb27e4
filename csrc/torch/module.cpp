// tk_ops._C: an empty Python module. Importing it loads the shared library, whose
// TORCH_LIBRARY_IMPL blocks register the CUDA kernels of the tk ops.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "CUDA kernels of the tk ops (registered on import)",
                               -1, nullptr};
  return PyModule_Create(&module);
}
