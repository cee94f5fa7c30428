// The ordered row sums of moe_dispatch/semantics/sums.py on the CPU, in one pass over the rows:
// every output's rows, ascending as the plan lists them, added into an fp32 accumulator (each
// row times its fp32 scale first, when given) and rounded once to the rows' dtype. These are the
// additions of the torch path there, in its order, with its roundings (bf16 and fp16 round to
// nearest even, as c10 does), so the bits are the same; the torch path gathers the rows of each
// slot and copies the sums twice, this pass reads each row once. No fused multiply-add may join a
// scale's product and its addition: CMakeLists.txt compiles this file with -ffp-contract=off.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace moe_dispatch {
namespace {

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN (c10's canonical quiet NaN)
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in fp32
    const float magnitude = static_cast<float>(mantissa) * from_bits(0x33800000u);
    return from_bits(sign | to_bits(magnitude));
  }
  if (exponent == 0x1f) return from_bits(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  return from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t float_to_half(float f) {
  const uint32_t u = to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (a >= 0x47800000u) return sign | 0x7c00;  // 2^16 and beyond (inf included): inf
  if (a >= 0x38800000u) {                      // a normal half: rebias the exponent, round 13 bits
    const uint32_t m = a - 0x38000000u;
    return sign | static_cast<uint16_t>((m + 0x0fffu + ((m >> 13) & 1u)) >> 13);  // a carry is right
  }
  if (a < 0x33000000u) return sign;  // below 2^-25: zero (2^-25 itself ties to zero below)
  // A subnormal half: the value in units of 2^-24, rounded to nearest even.
  const uint32_t exponent = a >> 23, mantissa = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exponent;  // 14 ... 24
  uint32_t q = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

struct Bf16 {
  using T = uint16_t;
  static float load(T v) { return bf16_to_float(v); }
  static T store(float f) { return float_to_bf16(f); }
};
struct F16 {
  using T = uint16_t;
  static float load(T v) { return half_to_float(v); }
  static T store(float f) { return float_to_half(f); }
};
struct F32 {
  using T = float;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
};

// out[o] = round(+0 + rows[terms[offsets[o]]] (x scale) + ...) for o < num_out.
template <class E>
void sum_rows(const typename E::T* rows, int64_t row_stride, int64_t width, const int64_t* offsets,
              const int64_t* terms, const float* scale, typename E::T* out, int64_t out_stride, int64_t num_out) {
  std::vector<float> acc(static_cast<size_t>(width));
  for (int64_t o = 0; o < num_out; ++o) {
    float* a = acc.data();
    for (int64_t h = 0; h < width; ++h) a[h] = 0.0f;
    for (int64_t t = offsets[o]; t < offsets[o + 1]; ++t) {
      const typename E::T* r = rows + terms[t] * row_stride;
      if (t + 1 < offsets[num_out]) {  // the next row's lines while this one is added (rows come in any order)
        const char* next = reinterpret_cast<const char*>(rows + terms[t + 1] * row_stride);
        for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(typename E::T)); b += 64)
          __builtin_prefetch(next + b);
      }
      if (scale != nullptr) {
        const float s = scale[terms[t]];
        for (int64_t h = 0; h < width; ++h) {
          const float product = E::load(r[h]) * s;
          a[h] += product;
        }
      } else {
        for (int64_t h = 0; h < width; ++h) a[h] += E::load(r[h]);
      }
    }
    typename E::T* dst = out + o * out_stride;
    for (int64_t h = 0; h < width; ++h) dst[h] = E::store(a[h]);
  }
}

}  // namespace

void register_sums(py::module_& m) {
  m.def(
      "ordered_sum_cpu",
      [](std::uintptr_t rows, int64_t row_stride, int64_t width, int dtype, std::uintptr_t offsets,
         std::uintptr_t terms, std::uintptr_t scale, std::uintptr_t out, int64_t out_stride, int64_t num_out) {
        const auto* off = reinterpret_cast<const int64_t*>(offsets);
        const auto* idx = reinterpret_cast<const int64_t*>(terms);
        const auto* s = reinterpret_cast<const float*>(scale);  // 0: no scales
        py::gil_scoped_release release;
        switch (dtype) {
          case 0:
            sum_rows<Bf16>(reinterpret_cast<const uint16_t*>(rows), row_stride, width, off, idx, s,
                           reinterpret_cast<uint16_t*>(out), out_stride, num_out);
            break;
          case 1:
            sum_rows<F16>(reinterpret_cast<const uint16_t*>(rows), row_stride, width, off, idx, s,
                          reinterpret_cast<uint16_t*>(out), out_stride, num_out);
            break;
          case 2:
            sum_rows<F32>(reinterpret_cast<const float*>(rows), row_stride, width, off, idx, s,
                          reinterpret_cast<float*>(out), out_stride, num_out);
            break;
          default:
            throw std::invalid_argument("ordered_sum_cpu: dtype code must be 0 (bf16), 1 (fp16) or 2 (fp32), got " +
                                        std::to_string(dtype));
        }
      },
      py::arg("rows"), py::arg("row_stride"), py::arg("width"), py::arg("dtype"), py::arg("offsets"), py::arg("terms"),
      py::arg("scale"), py::arg("out"), py::arg("out_stride"), py::arg("num_out"),
      "Host memory only: out[o] (num_out rows of width elements, out_stride apart) = the fp32 sum of "
      "rows[terms[offsets[o] .. offsets[o+1])] (row_stride apart; each times scale[row] unless scale is 0), "
      "rounded once to dtype (0 bf16, 1 fp16, 2 fp32). moe_dispatch/semantics/sums.py's ordered_sum.");
}

}  // namespace moe_dispatch
