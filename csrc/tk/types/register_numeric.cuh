// Conversions between the element types of register tiles and vectors, one element or one packed
// pair at a time. Arithmetic on tiles widens to float and rounds back once (ops/warp/maps.cuh), so
// these are the only per-type functions the warp ops need.
#pragma once

#include <type_traits>

#include "../common.cuh"

namespace tk {

template <typename T> struct numeric;

template <> struct numeric<float> {
  __device__ static float to_float(float x) { return x; }
  __device__ static float from_float(float x) { return x; }
  __device__ static float2 pair_to_float2(float2 p) { return p; }
  __device__ static float2 pair_from_float2(float2 p) { return p; }
};

template <> struct numeric<bf16> {
  __device__ static float to_float(bf16 x) { return __bfloat162float(x); }
  __device__ static bf16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static float2 pair_to_float2(bf16_2 p) { return __bfloat1622float2(p); }
  __device__ static bf16_2 pair_from_float2(float2 p) { return __float22bfloat162_rn(p); }
};

template <> struct numeric<half> {
  __device__ static float to_float(half x) { return __half2float(x); }
  __device__ static half from_float(float x) { return __float2half_rn(x); }
  __device__ static float2 pair_to_float2(half_2 p) { return __half22float2(p); }
  __device__ static half_2 pair_from_float2(float2 p) { return __float22half2_rn(p); }
};

template <typename T> constexpr bool is_register_element = std::is_same_v<T, float> || is_16bit_float<T>;

// The element type of a packed pair type.
template <typename P> struct pair_element;
template <> struct pair_element<float2> { using type = float; };
template <> struct pair_element<bf16_2> { using type = bf16; };
template <> struct pair_element<half_2> { using type = half; };
template <typename P> using pair_element_t = typename pair_element<P>::type;

template <typename To, typename From>
__device__ __forceinline__ To convert(From x) {
  if constexpr (std::is_same_v<To, From>) {
    return x;
  } else {
    return numeric<To>::from_float(numeric<From>::to_float(x));
  }
}

template <typename ToPair, typename FromPair>
__device__ __forceinline__ ToPair convert_pair(FromPair p) {
  if constexpr (std::is_same_v<ToPair, FromPair>) {
    return p;
  } else {
    using from = pair_element_t<FromPair>;
    using to = pair_element_t<ToPair>;
    return numeric<to>::pair_from_float2(numeric<from>::pair_to_float2(p));
  }
}

template <typename P>
__device__ __forceinline__ float2 to_float2(P p) {
  return numeric<pair_element_t<P>>::pair_to_float2(p);
}

// Element e (0: low half, 1: high half) of a packed pair.
template <typename P>
__device__ __forceinline__ pair_element_t<P> pair_get(const P& p, int e) {
  return e == 0 ? p.x : p.y;
}

// The 32 bits of a 16-bit pair, as tensor-core instructions take them, and back.
template <typename P>
__device__ __forceinline__ uint32_t pair_bits(P p) {
  static_assert(sizeof(P) == sizeof(uint32_t), "only pairs of 16-bit elements fit one register");
  uint32_t bits;
  __builtin_memcpy(&bits, &p, sizeof(bits));  // the CUDA pair types are not trivially copyable: no bit_cast
  return bits;
}
template <typename P>
__device__ __forceinline__ P pair_from_bits(uint32_t bits) {
  static_assert(sizeof(P) == sizeof(uint32_t), "only pairs of 16-bit elements fit one register");
  P p;
  __builtin_memcpy(&p, &bits, sizeof(bits));
  return p;
}

}  // namespace tk
