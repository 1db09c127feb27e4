// From run-time values to a kernel variant: one table for every variant axis (element type, head
// dim, flags), instead of a nested switch or a hand-made bit index per op.
//
//   using head_dims = tk::one_of<64, 128>;
//   using dtypes = tk::one_of<tk::element_type::bf16, tk::element_type::fp16>;
//   if (!head_dims::contains(d)) return "the head dim must be one of " + head_dims::names();
//   return tk::dispatch<dtypes, head_dims, tk::flags>(
//       [&]<tk::element_type E, int D, bool CAUSAL>() { return run<tk::element_t<E>, D, CAUSAL>(p); },
//       p.dtype, d, p.causal);
//
// Every combination of the lists is instantiated. Host code only; a value outside its list is a
// caller bug (check `contains` first) and throws std::invalid_argument.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace tk {

template <auto... VALUES>
struct one_of {
  template <typename V>
  static constexpr bool contains(V value) {
    return ((value == static_cast<V>(VALUES)) || ...);
  }
  // {64, 128}: an integer list as data (what the kernels take, for tk_ops._library.kernel_support).
  static std::vector<int64_t> integers()
    requires(std::is_integral_v<decltype(VALUES)> && ...)
  {
    return {static_cast<int64_t>(VALUES)...};
  }
  // "64, 128": for error messages.
  static std::string names() {
    std::string text;
    ((text += (text.empty() ? "" : ", ") + std::to_string(VALUES)), ...);
    return text;
  }
};

using flags = one_of<false, true>;

namespace detail {

template <auto... CHOSEN>
struct chosen {};

template <typename Chosen, typename... Lists>
struct dispatcher;

template <auto... CHOSEN>
struct dispatcher<chosen<CHOSEN...>> {
  template <typename F>
  static decltype(auto) run(F& f) {
    return f.template operator()<CHOSEN...>();
  }
};

template <auto... CHOSEN, auto FIRST, auto... OPTIONS, typename... Rest>
struct dispatcher<chosen<CHOSEN...>, one_of<FIRST, OPTIONS...>, Rest...> {
  template <typename F, typename V, typename... Vs>
  static auto run(F& f, V value, Vs... rest) {
    using result = decltype(dispatcher<chosen<CHOSEN..., FIRST>, Rest...>::run(f, rest...));
    static_assert(std::is_default_constructible_v<result>, "dispatched functions return a value (an error, a reason)");
    result out{};
    const auto pick = [&]<auto OPTION>() {
      if (value != static_cast<V>(OPTION)) return false;
      out = dispatcher<chosen<CHOSEN..., OPTION>, Rest...>::run(f, rest...);
      return true;
    };
    const bool found = (pick.template operator()<FIRST>() || ... || pick.template operator()<OPTIONS>());
    if (!found) throw std::invalid_argument("tk::dispatch: a value outside its variant list (check contains() first)");
    return out;
  }
};

}  // namespace detail

// f.template operator()<V0, V1, ...>() where Vi is the entry of the i-th list equal to values[i].
template <typename... Lists, typename F, typename... Values>
auto dispatch(F&& f, Values... values) {
  static_assert(sizeof...(Lists) == sizeof...(Values), "one run-time value per variant list");
  return detail::dispatcher<detail::chosen<>, Lists...>::run(f, values...);
}

}  // namespace tk
