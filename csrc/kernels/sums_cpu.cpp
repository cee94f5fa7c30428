// The ordered row sums of moe_dispatch/semantics/sums.py on the CPU (levels of the summation order that
// moe_dispatch/semantics/summation.py defines), each in one pass over the rows:
// - ordered_sum_cpu: every output's rows, ascending as the plan lists them, added into an fp32
//   accumulator (each row times its fp32 scale first, when given) and rounded once;
// - grouped_sum_cpu: sums of such sums (a combine's node partials, each rounded, then their sum);
//   both read the rows where they are: row-strided, or left in the blocks of the exchange that
//   carried them (no copy out first);
// - plan_by_row_cpu / plan_by_output_cpu: their plans, each output's rows ascending, in one pass.
// These are the additions of the torch path, in its order, with its roundings (bf16 and fp16
// round to nearest even, as c10 does), so the bits are the same; the torch path gathers the rows
// of each slot and copies the sums twice. No fused multiply-add may join a scale's product and
// its addition: CMakeLists.txt compiles this file with -ffp-contract=off.
#include <pybind11/pybind11.h>

#include <algorithm>
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

// Where the rows are: row r at base + r * row_stride, or, for rows left in the blocks of the
// exchange that carried them (num_blocks > 0), block b holding rows first[b] .. first[b + 1] - 1,
// the first at base + b * block_stride, row_stride apart. Strides in elements.
struct Rows {
  const void* base;
  int64_t row_stride;
  int64_t block_stride = 0;
  int64_t num_blocks = 0;
  const int64_t* first = nullptr;

  template <class T>
  const T* at(int64_t r) const {
    const T* p = static_cast<const T*>(base);
    if (num_blocks == 0) return p + r * row_stride;
    const int64_t b = std::upper_bound(first + 1, first + num_blocks + 1, r) - (first + 1);
    return p + b * block_stride + (r - first[b]) * row_stride;
  }
};

// One term's value in fp32: the row's element, times the row's scale when there is one (a
// separate rounding: no FMA, see the file comment).
template <class E>
inline float term(const typename E::T* r, int64_t h, const float* s) {
  return s != nullptr ? E::load(r[h]) * *s : E::load(r[h]);
}

// out[o] = round(+0 + rows[terms[offsets[o]]] (x scale) + ...) for o < num_out. The first term
// starts the accumulator (from +0, so -0 becomes +0 as in the torch path) and the last is added
// as the sum is rounded: an output of one term is a single converting copy.
template <class E>
inline __attribute__((always_inline)) void gather_rows(const Rows& rows, int64_t width, const int64_t* offsets,
                                                       const int64_t* terms, const float* scale, typename E::T* out,
                                                       int64_t out_stride, int64_t num_out, float* acc) {
  using T = typename E::T;
  const int64_t num_terms = offsets[num_out];
  for (int64_t o = 0; o < num_out; ++o) {
    T* dst = out + o * out_stride;
    const int64_t first = offsets[o], last = offsets[o + 1] - 1;
    if (last < first) {
      std::memset(dst, 0, static_cast<size_t>(width) * sizeof(T));
      continue;
    }
    for (int64_t t = first; t <= last; ++t) {
      const T* r = rows.at<T>(terms[t]);
      const float* s = scale != nullptr ? scale + terms[t] : nullptr;
      if (t + 1 < num_terms) {  // the next row's lines while this one is added (rows come in any order)
        const char* next = reinterpret_cast<const char*>(rows.at<T>(terms[t + 1]));
        for (int64_t b = 0; b < width * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(next + b);
      }
      if (t == first && t == last) {
        for (int64_t h = 0; h < width; ++h) dst[h] = E::store(0.0f + term<E>(r, h, s));
      } else if (t == first) {
        for (int64_t h = 0; h < width; ++h) acc[h] = 0.0f + term<E>(r, h, s);
      } else if (t == last) {
        for (int64_t h = 0; h < width; ++h) dst[h] = E::store(acc[h] + term<E>(r, h, s));
      } else {
        for (int64_t h = 0; h < width; ++h) acc[h] += term<E>(r, h, s);
      }
    }
  }
}

// Sums of sums, in one pass: out[o] = round(+0 + g_1 + g_2 + ...) over o's groups
// groups[group_offsets[o] .. group_offsets[o+1]), each g = round(+0 + its rows (x scale) + ...)
// over terms[row_offsets[g] .. row_offsets[g+1]), every sum in fp32 in the listed order (a
// combine's node partials, then their sum). acc: 2 x width floats.
template <class E>
inline __attribute__((always_inline)) void gather_groups(const Rows& rows, int64_t width, const int64_t* group_offsets,
                                                         const int64_t* row_offsets, const int64_t* terms,
                                                         const float* scale, typename E::T* out, int64_t out_stride,
                                                         int64_t num_out, float* acc) {
  using T = typename E::T;
  float* inner = acc;
  float* outer = acc + width;
  for (int64_t o = 0; o < num_out; ++o) {
    for (int64_t h = 0; h < width; ++h) outer[h] = 0.0f;
    for (int64_t g = group_offsets[o]; g < group_offsets[o + 1]; ++g) {
      for (int64_t h = 0; h < width; ++h) inner[h] = 0.0f;
      for (int64_t t = row_offsets[g]; t < row_offsets[g + 1]; ++t) {
        const T* r = rows.at<T>(terms[t]);
        const float* s = scale != nullptr ? scale + terms[t] : nullptr;
        for (int64_t h = 0; h < width; ++h) inner[h] += term<E>(r, h, s);
      }
      for (int64_t h = 0; h < width; ++h) outer[h] += E::load(E::store(inner[h]));  // the group's rounding
    }
    T* dst = out + o * out_stride;
    for (int64_t h = 0; h < width; ++h) dst[h] = E::store(outer[h]);
  }
}

// The entry points, compiled for AVX-512 and AVX2 beside the baseline where the compiler can
// (the loader picks the clone the CPU runs; the arithmetic is the same IEEE fp32 in every clone).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MOE_DISPATCH_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define MOE_DISPATCH_CPU_CLONES
#endif

MOE_DISPATCH_CPU_CLONES
void gather_sum(int dtype, const Rows& rows, int64_t width, const int64_t* offsets, const int64_t* terms,
                const float* scale, void* out, int64_t out_stride, int64_t num_out, float* acc) {
  switch (dtype) {
    case 0:
      gather_rows<Bf16>(rows, width, offsets, terms, scale, static_cast<uint16_t*>(out), out_stride, num_out, acc);
      break;
    case 1:
      gather_rows<F16>(rows, width, offsets, terms, scale, static_cast<uint16_t*>(out), out_stride, num_out, acc);
      break;
    default:
      gather_rows<F32>(rows, width, offsets, terms, scale, static_cast<float*>(out), out_stride, num_out, acc);
  }
}

MOE_DISPATCH_CPU_CLONES
void grouped_sum(int dtype, const Rows& rows, int64_t width, const int64_t* group_offsets, const int64_t* row_offsets,
                 const int64_t* terms, const float* scale, void* out, int64_t out_stride, int64_t num_out, float* acc) {
  switch (dtype) {
    case 0:
      gather_groups<Bf16>(rows, width, group_offsets, row_offsets, terms, scale, static_cast<uint16_t*>(out),
                          out_stride, num_out, acc);
      break;
    case 1:
      gather_groups<F16>(rows, width, group_offsets, row_offsets, terms, scale, static_cast<uint16_t*>(out), out_stride,
                         num_out, acc);
      break;
    default:
      gather_groups<F32>(rows, width, group_offsets, row_offsets, terms, scale, static_cast<float*>(out), out_stride,
                         num_out, acc);
  }
}

// The one pass's plan from each output's list of rows (a permute's row map): terms[o * K + k] is a
// row of output o, or outside [0, num_rows) for none; writes offsets [num_out + 1] and each
// output's rows ascending into sorted (num_out * K at most); returns the number of rows listed.
template <class I>
int64_t plan_by_output(const I* terms, int64_t num_out, int64_t num_topk, int64_t num_rows, int64_t* offsets,
                       int64_t* sorted) {
  int64_t n = 0;
  offsets[0] = 0;
  for (int64_t o = 0; o < num_out; ++o) {
    const int64_t first = n;
    for (int64_t k = 0; k < num_topk; ++k) {
      const int64_t row = static_cast<int64_t>(terms[o * num_topk + k]);
      if (row < 0 || row >= num_rows) continue;
      int64_t at = n++;  // insertion sort: K is small
      while (at > first && sorted[at - 1] > row) {
        sorted[at] = sorted[at - 1];
        --at;
      }
      sorted[at] = row;
    }
    offsets[o + 1] = n;
  }
  return n;
}

// The one pass's plan from each row's output (index[i] in [0, num_out], num_out: left out): a
// counting sort, stable, so each output's rows come ascending. offsets [num_out + 1], sorted
// [n] at most; returns the number of rows summed.
int64_t plan_by_row(const int64_t* index, int64_t n, int64_t num_out, int64_t* offsets, int64_t* sorted) {
  std::fill(offsets, offsets + num_out + 1, 0);
  for (int64_t i = 0; i < n; ++i)
    if (index[i] >= 0 && index[i] < num_out) ++offsets[index[i] + 1];
  for (int64_t o = 0; o < num_out; ++o) offsets[o + 1] += offsets[o];
  std::vector<int64_t> next(offsets, offsets + num_out);
  for (int64_t i = 0; i < n; ++i)
    if (index[i] >= 0 && index[i] < num_out) sorted[next[index[i]]++] = i;
  return offsets[num_out];
}

Rows rows_of(std::uintptr_t rows, int64_t row_stride, int64_t block_stride, int64_t num_blocks,
             std::uintptr_t block_first) {
  if (num_blocks < 0 || (num_blocks > 0 && block_first == 0))
    throw std::invalid_argument("the sums' rows in blocks need num_blocks >= 0 and, with blocks, block_first");
  return Rows{reinterpret_cast<const void*>(rows), row_stride, block_stride, num_blocks,
              reinterpret_cast<const int64_t*>(block_first)};
}

void check_dtype(const char* name, int dtype) {
  if (dtype < 0 || dtype > 2)
    throw std::invalid_argument(std::string(name) + ": dtype code must be 0 (bf16), 1 (fp16) or 2 (fp32), got " +
                                std::to_string(dtype));
}

}  // namespace

void register_sums(py::module_& m) {
  m.def(
      "ordered_sum_cpu",
      [](std::uintptr_t rows, int64_t row_stride, int64_t width, int dtype, std::uintptr_t offsets,
         std::uintptr_t terms, std::uintptr_t scale, std::uintptr_t out, int64_t out_stride, int64_t num_out,
         int64_t block_stride, int64_t num_blocks, std::uintptr_t block_first) {
        check_dtype("ordered_sum_cpu", dtype);
        std::vector<float> acc(static_cast<size_t>(width));
        py::gil_scoped_release release;
        gather_sum(dtype, rows_of(rows, row_stride, block_stride, num_blocks, block_first), width,
                   reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<const int64_t*>(terms),
                   reinterpret_cast<const float*>(scale), reinterpret_cast<void*>(out), out_stride, num_out,
                   acc.data());
      },
      py::arg("rows"), py::arg("row_stride"), py::arg("width"), py::arg("dtype"), py::arg("offsets"), py::arg("terms"),
      py::arg("scale"), py::arg("out"), py::arg("out_stride"), py::arg("num_out"), py::arg("block_stride") = 0,
      py::arg("num_blocks") = 0, py::arg("block_first") = 0,
      "Host memory only: out[o] (num_out rows of width elements, out_stride apart) = the fp32 sum of "
      "rows[terms[offsets[o] .. offsets[o+1])] (row_stride apart, or, with num_blocks, in blocks block_stride "
      "apart, block b's first row block_first[b]; each times scale[row] unless scale is 0), "
      "rounded once to dtype (0 bf16, 1 fp16, 2 fp32). moe_dispatch/semantics/sums.py's ordered_sum.");
  m.def(
      "grouped_sum_cpu",
      [](std::uintptr_t rows, int64_t row_stride, int64_t width, int dtype, std::uintptr_t group_offsets,
         std::uintptr_t row_offsets, std::uintptr_t terms, std::uintptr_t scale, std::uintptr_t out, int64_t out_stride,
         int64_t num_out, int64_t block_stride, int64_t num_blocks, std::uintptr_t block_first) {
        check_dtype("grouped_sum_cpu", dtype);
        std::vector<float> acc(2 * static_cast<size_t>(width));
        py::gil_scoped_release release;
        grouped_sum(dtype, rows_of(rows, row_stride, block_stride, num_blocks, block_first), width,
                    reinterpret_cast<const int64_t*>(group_offsets), reinterpret_cast<const int64_t*>(row_offsets),
                    reinterpret_cast<const int64_t*>(terms), reinterpret_cast<const float*>(scale),
                    reinterpret_cast<void*>(out), out_stride, num_out, acc.data());
      },
      py::arg("rows"), py::arg("row_stride"), py::arg("width"), py::arg("dtype"), py::arg("group_offsets"),
      py::arg("row_offsets"), py::arg("terms"), py::arg("scale"), py::arg("out"), py::arg("out_stride"),
      py::arg("num_out"), py::arg("block_stride") = 0, py::arg("num_blocks") = 0, py::arg("block_first") = 0,
      "Host memory only: out[o] = the fp32 sum, rounded once to dtype, of o's groups "
      "[group_offsets[o], group_offsets[o+1]), each group g the fp32 sum of rows[terms[row_offsets[g] .. "
      "row_offsets[g+1])] (rows as ordered_sum_cpu reads them; each times scale[row] unless scale is 0) rounded "
      "to dtype. A two-level combine.");
  m.def(
      "plan_by_row_cpu",
      [](std::uintptr_t index, int64_t n, int64_t num_out, std::uintptr_t offsets, std::uintptr_t sorted) {
        return plan_by_row(reinterpret_cast<const int64_t*>(index), n, num_out, reinterpret_cast<int64_t*>(offsets),
                           reinterpret_cast<int64_t*>(sorted));
      },
      py::arg("index"), py::arg("n"), py::arg("num_out"), py::arg("offsets"), py::arg("sorted"),
      "Host memory only: from index [n] int64 (each row's output; num_out leaves it out), offsets [num_out + 1] "
      "int64 and each output's rows ascending in sorted (int64, n at most): ordered_sum_cpu's plan. Returns the "
      "number of rows summed.");
  m.def(
      "plan_by_output_cpu",
      [](std::uintptr_t terms, int index_bytes, int64_t num_out, int64_t num_topk, int64_t num_rows,
         std::uintptr_t offsets, std::uintptr_t sorted) {
        auto* off = reinterpret_cast<int64_t*>(offsets);
        auto* out = reinterpret_cast<int64_t*>(sorted);
        if (index_bytes == 4)
          return plan_by_output(reinterpret_cast<const int32_t*>(terms), num_out, num_topk, num_rows, off, out);
        if (index_bytes == 8)
          return plan_by_output(reinterpret_cast<const int64_t*>(terms), num_out, num_topk, num_rows, off, out);
        throw std::invalid_argument("plan_by_output_cpu: index_bytes must be 4 or 8, got " +
                                    std::to_string(index_bytes));
      },
      py::arg("terms"), py::arg("index_bytes"), py::arg("num_out"), py::arg("num_topk"), py::arg("num_rows"),
      py::arg("offsets"), py::arg("sorted"),
      "Host memory only: from terms [num_out, num_topk] (int32 or int64 rows, outside [0, num_rows) for none), "
      "offsets [num_out + 1] int64 and each output's rows ascending in sorted (int64, num_out * num_topk at "
      "most): ordered_sum_cpu's plan. Returns the number of rows listed.");
}

}  // namespace moe_dispatch
