// What each op's kernels take (head dims, ...), declared beside the op's registration from the
// kernels' own lists, so that Python asks (tk_ops._C.kernel_support(), read through
// tk_ops._library.kernel_support) instead of restating them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tk::registration {

// op name -> property ("head_dims") -> the values the kernels take.
using support_table = std::map<std::string, std::map<std::string, std::vector<int64_t>>>;

// One table for the whole library (an inline function's static is shared by every translation unit).
inline support_table& declared_support() {
  static support_table table;
  return table;
}

// A namespace-scope instance declares, when the library loads, that `op`'s kernels take exactly
// `values` for `property`.
struct kernel_support {
  kernel_support(const char* op, const char* property, std::vector<int64_t> values) {
    declared_support()[op][property] = std::move(values);
  }
};

}  // namespace tk::registration
