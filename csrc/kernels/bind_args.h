// Typed Python classes of the kernels' argument structs, shared by intranode_bindings.cpp and
// internode_bindings.cpp. Python builds each struct by keyword, one argument per field, with the
// field's C++ type: device pointers as ints (None or 0 = null), integers range-checked into their
// C++ width, nested structs as their classes (`check=Check(...)`). A missing required field, or a
// value that does not fit, raises ValueError naming the struct and the field; an unknown field
// raises TypeError. The layouts (BufferLayout, SlotLayout, RdmaLayout) are read-only: only _C's
// layout functions make them, so the kernels' byte layouts have one source, the C++ headers.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/intranode.cuh"
#include "kernels/intranode_cpu.h"

namespace moe_dispatch {
namespace bind {

namespace py = pybind11;

// A struct's class: fields added one by one, then init() defines the keyword constructor.
template <class T>
class Struct {
 public:
  // `what`: the struct as error messages name it; `initial`: the value of fields not given.
  Struct(py::module_& m, const char* name, const char* what, const char* doc, T initial = T{})
      : cls_(m, name, doc), what_(what), initial_(initial) {}

  template <class P>
  Struct& pointer(const char* name, P* T::* field, bool required = true) {
    cls_.def_property(
        name,
        [field](const T& t) -> py::object {
          if (t.*field == nullptr) return py::none();
          return py::int_(reinterpret_cast<std::uintptr_t>(t.*field));
        },
        [field](T& t, const py::object& v) {
          t.*field = v.is_none() ? nullptr : reinterpret_cast<P*>(v.cast<std::uintptr_t>());
        });
    return add(name, required);
  }

  template <class I>
  Struct& integer(const char* name, I T::* field, bool required = true) {
    const std::string where = what_ + "." + name;
    cls_.def_property(
        name, [field](const T& t) { return static_cast<int64_t>(t.*field); },
        [field, where](T& t, int64_t v) {
          MOE_HOST_CHECK(v >= std::numeric_limits<I>::min() && v <= std::numeric_limits<I>::max(),
                         where << " = " << v << " does not fit int" << 8 * sizeof(I));
          t.*field = static_cast<I>(v);
        });
    return add(name, required);
  }

  // A nested struct (a class registered before this one).
  template <class S>
  Struct& member(const char* name, S T::* field, bool required = true) {
    cls_.def_property(name, [field](const T& t) { return t.*field; }, [field](T& t, const S& v) { t.*field = v; });
    return add(name, required);
  }

  // A fixed array of addresses, listed from its first entry (the rest stay null).
  template <class P, size_t N>
  Struct& addresses(const char* name, P* (T::*field)[N], bool required = true) {
    const std::string where = what_ + "." + name;
    cls_.def_property(
        name,
        [field](const T& t) {
          std::vector<std::uintptr_t> out;
          for (size_t i = 0; i < N; ++i) out.push_back(reinterpret_cast<std::uintptr_t>((t.*field)[i]));
          return out;
        },
        [field, where](T& t, const std::vector<std::uintptr_t>& v) {
          MOE_HOST_CHECK(v.size() <= N, where << " lists at most " << N << " buffers, got " << v.size());
          for (size_t i = 0; i < N; ++i) (t.*field)[i] = i < v.size() ? reinterpret_cast<P*>(v[i]) : nullptr;
        });
    return add(name, required);
  }

  // Any other property (getter, setter), e.g. an array of words.
  template <class Get, class Set>
  Struct& property(const char* name, Get get, Set set, bool required = true) {
    cls_.def_property(name, get, set);
    return add(name, required);
  }

  py::class_<T>& init() {
    cls_.def(py::init([names = names_, required = required_, what = what_, initial = initial_](const py::kwargs& kw) {
      for (auto item : kw) {
        const auto key = item.first.cast<std::string>();
        bool known = false;
        for (const auto& n : names) known = known || n == key;
        if (!known) throw py::type_error(what + " has no field '" + key + "'");
      }
      for (size_t i = 0; i < names.size(); ++i)
        MOE_HOST_CHECK(!required[i] || kw.contains(names[i]), what << " is missing '" << names[i] << "'");
      py::object self = py::cast(initial);
      for (auto item : kw) self.attr(item.first) = item.second;
      return self.cast<T>();
    }));
    cls_.def("__repr__", [names = names_, what = what_](const py::object& self) {
      std::string s = what + "(";
      for (size_t i = 0; i < names.size(); ++i)
        s += (i ? ", " : "") + names[i] + "=" + py::repr(self.attr(names[i].c_str())).template cast<std::string>();
      return s + ")";
    });
    return cls_;
  }

 private:
  Struct& add(const char* name, bool required) {
    names_.emplace_back(name);
    required_.push_back(required);
    return *this;
  }

  py::class_<T> cls_;
  std::string what_;
  T initial_;
  std::vector<std::string> names_;
  std::vector<bool> required_;
};

// A read-only layout class: its fields and to_dict() (what the Python mirrors compare against).
template <class T>
class Layout {
 public:
  Layout(py::module_& m, const char* name, const char* doc) : cls_(m, name, doc) {}

  template <class I>
  Layout& field(const char* name, I T::* member) {
    cls_.def_readonly(name, member);
    names_.emplace_back(name);
    return *this;
  }

  void done() {
    cls_.def("to_dict", [names = names_](const py::object& self) {
      py::dict d;
      for (const auto& n : names) d[n.c_str()] = self.attr(n.c_str());
      return d;
    });
    cls_.def("__repr__", [names = names_](const py::object& self) {
      return "Layout(" + py::repr(self.attr("to_dict")()).template cast<std::string>() + ")";
    });
    cls_.def("__eq__", [](const py::object& a, const py::object& b) {
      return py::type::of(a).is(py::type::of(b)) && a.attr("to_dict")().equal(b.attr("to_dict")());
    });
  }

 private:
  py::class_<T> cls_;
  std::vector<std::string> names_;
};

inline void check_backend(const std::string& backend) {
  MOE_HOST_CHECK(backend == "cuda" || backend == "cpu", "backend must be 'cuda' or 'cpu', got '" << backend << "'");
}

inline cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

// Copies a launch's rank structs into the args' fixed array (1 to `most` ranks); returns their count.
template <class Rank, size_t N>
int32_t copy_ranks(const std::vector<Rank>& ranks, Rank (&out)[N], size_t most = N) {
  MOE_HOST_CHECK(ranks.size() >= 1 && ranks.size() <= most,
                 "ranks must list 1 to " << most << " launched ranks, got " << ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) out[i] = ranks[i];
  return static_cast<int32_t>(ranks.size());
}

// The slot of a dispatch (x row, fp8 scales, top-k ids and weights) or, with scale_bytes =
// num_topk = 0, of a combine; `what` names the row argument ("x_bytes" or "y_bytes").
inline intranode::SlotLayout checked_slot(int64_t x_bytes, int64_t scale_bytes, int64_t num_topk,
                                          const char* what = "x_bytes") {
  MOE_HOST_CHECK(x_bytes > 0 && x_bytes <= INT32_MAX / 2, what << " must be in (0, 2^30), got " << x_bytes);
  MOE_HOST_CHECK(scale_bytes >= 0 && scale_bytes <= INT32_MAX / 2,
                 "scale_bytes must be in [0, 2^30), got " << scale_bytes);
  MOE_HOST_CHECK(num_topk >= 0 && num_topk <= intranode::kMaxTopk,
                 "num_topk must be in [0, " << intranode::kMaxTopk << "], got " << num_topk);
  return intranode::make_slot_layout(static_cast<int>(x_bytes), static_cast<int>(scale_bytes),
                                     static_cast<int>(num_topk));
}

// The classes both kernel families share: Variant, CpuOptions, Check, the intranode layouts and
// rank structs (the staged internode stage 1 runs the intranode rank structs).
void register_arg_types(py::module_& m);

}  // namespace bind
}  // namespace moe_dispatch
