// The torch_dist transport's blocks on the CPU, written in one pass: for each destination its
// header, then its rows, each the row tensors' fields side by side (moe_dispatch/transport/
// torch_dist.py's _pack layout: every field padded to 8 bytes, padding zeroed), gathered from
// the sources by an index. Torch needs a gather into a packed buffer, then a copy per destination.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace moe_dispatch {
namespace {

struct Field {
  const uint8_t* src;
  int64_t stride;  // bytes between source rows
  int64_t bytes;   // of one row's field
  int64_t offset;  // in the packed row
};

}  // namespace

void register_pack(py::module_& m) {
  m.def(
      "pack_blocks_cpu",
      [](std::uintptr_t out, int64_t block_bytes, std::uintptr_t head, int64_t head_bytes, int64_t row_bytes,
         const std::vector<std::tuple<std::uintptr_t, int64_t, int64_t, int64_t>>& fields, std::uintptr_t index,
         const std::vector<int64_t>& splits) {
        std::vector<Field> f;
        int64_t end = 0;  // of the previous field: fields come in order and do not overlap
        for (const auto& [src, stride, bytes, offset] : fields) {
          if (offset < end || bytes < 0 || offset + bytes > row_bytes)
            throw std::invalid_argument("pack_blocks_cpu: a field of " + std::to_string(bytes) + " bytes at " +
                                        std::to_string(offset) + " overlaps the previous one or does not fit rows of " +
                                        std::to_string(row_bytes) + " bytes");
          f.push_back({reinterpret_cast<const uint8_t*>(src), stride, bytes, offset});
          end = offset + bytes;
        }
        for (int64_t n : splits)
          if (n < 0 || head_bytes + n * row_bytes > block_bytes)
            throw std::invalid_argument("pack_blocks_cpu: " + std::to_string(n) + " rows of " +
                                        std::to_string(row_bytes) + " bytes do not fit a block of " +
                                        std::to_string(block_bytes) + " after a header of " +
                                        std::to_string(head_bytes));
        auto* dst = reinterpret_cast<uint8_t*>(out);
        const auto* heads = reinterpret_cast<const uint8_t*>(head);
        const auto* idx = reinterpret_cast<const int64_t*>(index);
        py::gil_scoped_release release;
        int64_t j = 0;
        for (size_t d = 0; d < splits.size(); ++d) {
          uint8_t* block = dst + static_cast<int64_t>(d) * block_bytes;
          std::memcpy(block, heads + static_cast<int64_t>(d) * head_bytes, static_cast<size_t>(head_bytes));
          for (int64_t pos = 0; pos < splits[d]; ++pos, ++j) {
            uint8_t* row = block + head_bytes + pos * row_bytes;
            const int64_t r = idx != nullptr ? idx[j] : j;
            int64_t end = 0;  // of the bytes written so far: the gaps between fields are zeroed
            for (const Field& field : f) {
              std::memset(row + end, 0, static_cast<size_t>(field.offset - end));
              std::memcpy(row + field.offset, field.src + r * field.stride, static_cast<size_t>(field.bytes));
              end = field.offset + field.bytes;
            }
            std::memset(row + end, 0, static_cast<size_t>(row_bytes - end));
          }
        }
      },
      py::arg("out"), py::arg("block_bytes"), py::arg("head"), py::arg("head_bytes"), py::arg("row_bytes"),
      py::arg("fields"), py::arg("index"), py::arg("splits"),
      "Host memory only: out [len(splits), block_bytes] uint8, block d = header d (head_bytes from head) then "
      "splits[d] packed rows of row_bytes: row j (rows counted across destinations) takes each field "
      "(src, src row stride, bytes, offset in the row) from source row index[j] (j when index is 0); the gaps "
      "are zeroed, the rest of each block is left as it was.");
}

}  // namespace moe_dispatch
