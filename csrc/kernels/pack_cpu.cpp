// The torch_dist transport's blocks on the CPU, written in one pass: for each destination its
// header, then its rows, each the row tensors' fields side by side (the layout of pack() in
// moe_dispatch/transport/torch_dist/packing.py: every field padded to 8 bytes, padding zeroed),
// gathered from the sources by an index. Torch needs a gather into a packed buffer, then a copy
// per destination.
// And the reverse: the received blocks' rows landed field by field straight into their outputs,
// in arrival order or gathered by an index (the fused permute's expert-major layout), instead of
// a concatenation of the blocks, then a gather per field.
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
         const std::vector<int64_t>& splits, int64_t count_word) {
        if (count_word >= 0 && (count_word + 1) * 8 > head_bytes)
          throw std::invalid_argument("pack_blocks_cpu: count_word " + std::to_string(count_word) +
                                      " is not in a header of " + std::to_string(head_bytes) + " bytes");
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
          if (count_word >= 0) std::memcpy(block + count_word * 8, &splits[d], sizeof(int64_t));
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
      py::arg("fields"), py::arg("index"), py::arg("splits"), py::arg("count_word") = -1,
      "Host memory only: out [len(splits), block_bytes] uint8, block d = header d (head_bytes from head; its "
      "int64 word count_word, if >= 0, set to splits[d]) then "
      "splits[d] packed rows of row_bytes: row j (rows counted across destinations) takes each field "
      "(src, src row stride, bytes, offset in the row) from source row index[j] (j when index is 0); the gaps "
      "are zeroed, the rest of each block is left as it was.");

  m.def(
      "land_blocks_cpu",
      [](std::uintptr_t blocks, int64_t block_bytes, int64_t head_bytes, int64_t row_bytes,
         const std::vector<int64_t>& carried,
         const std::vector<std::tuple<int64_t, int64_t, std::uintptr_t, int64_t, std::uintptr_t, int64_t>>& fields) {
        // rows[a]: where arrival row a (rows counted across sources) starts
        std::vector<const uint8_t*> rows;
        const auto* base = reinterpret_cast<const uint8_t*>(blocks);
        for (size_t s = 0; s < carried.size(); ++s) {
          if (carried[s] < 0 || head_bytes + carried[s] * row_bytes > block_bytes)
            throw std::invalid_argument("land_blocks_cpu: " + std::to_string(carried[s]) + " rows of " +
                                        std::to_string(row_bytes) + " bytes do not fit a block of " +
                                        std::to_string(block_bytes));
          for (int64_t j = 0; j < carried[s]; ++j)
            rows.push_back(base + static_cast<int64_t>(s) * block_bytes + head_bytes + j * row_bytes);
        }
        const auto num_rows = static_cast<int64_t>(rows.size());
        for (const auto& [offset, bytes, dst, dst_stride, index, num_out] : fields) {
          if (offset < 0 || bytes < 0 || offset + bytes > row_bytes || dst_stride < bytes)
            throw std::invalid_argument("land_blocks_cpu: a field of " + std::to_string(bytes) + " bytes at " +
                                        std::to_string(offset) + " does not fit rows of " + std::to_string(row_bytes) +
                                        " bytes or its output rows of " + std::to_string(dst_stride));
          if (index == 0 && num_out != num_rows)
            throw std::invalid_argument("land_blocks_cpu: " + std::to_string(num_out) +
                                        " output rows in arrival "
                                        "order, " +
                                        std::to_string(num_rows) + " arrived");
          const auto* idx = reinterpret_cast<const int64_t*>(index);
          for (int64_t i = 0; i < num_out; ++i)
            if (idx != nullptr && idx[i] >= num_rows)
              throw std::invalid_argument("land_blocks_cpu: output row " + std::to_string(i) + " takes arrival row " +
                                          std::to_string(idx[i]) + " of " + std::to_string(num_rows));
        }
        py::gil_scoped_release release;
        for (const auto& [offset, bytes, dst, dst_stride, index, num_out] : fields) {
          auto* out = reinterpret_cast<uint8_t*>(dst);
          const auto* idx = reinterpret_cast<const int64_t*>(index);
          for (int64_t i = 0; i < num_out; ++i) {
            const int64_t a = idx != nullptr ? idx[i] : i;
            if (a < 0)  // a zero row (padding); zero bits are +0.0 in every float format
              std::memset(out + i * dst_stride, 0, static_cast<size_t>(bytes));
            else
              std::memcpy(out + i * dst_stride, rows[a] + offset, static_cast<size_t>(bytes));
          }
        }
      },
      py::arg("blocks"), py::arg("block_bytes"), py::arg("head_bytes"), py::arg("row_bytes"), py::arg("carried"),
      py::arg("fields"),
      "Host memory only: blocks [len(carried), block_bytes] uint8, block s = a header of head_bytes, then "
      "carried[s] packed rows of row_bytes (the arrival rows, counted across blocks). Each field (offset in "
      "the row, bytes, dst, dst row stride in bytes, index, num_out) writes output row i of dst with the field of "
      "arrival row index[i] (i when index is 0; a zero row where index[i] is -1).");
}

}  // namespace moe_dispatch
