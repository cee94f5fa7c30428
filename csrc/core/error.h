// Error handling for the extension's host code. Nothing here exits the process: CUDA failures
// throw moe_dispatch::CudaError (bindings.cpp turns it into moe_dispatch._C.CudaError, a
// RuntimeError carrying code, name, file and line) and bad arguments throw
// std::invalid_argument (a Python ValueError). Teardown paths, which must not throw, use
// MOE_CUDA_CHECK_WARN instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace moe_dispatch {

// Cuts the build machine's prefix so messages read "csrc/kernels/layout.cu:42".
inline const char* source_path(const char* file) {
  const char* csrc = std::strstr(file, "csrc/");
  return csrc != nullptr ? csrc : file;
}

class CudaError : public std::runtime_error {
 public:
  CudaError(cudaError_t code, const char* expr, const char* file, int line)
      : std::runtime_error(describe(code, expr, file, line)), code_(code), file_(source_path(file)), line_(line) {}

  int code() const { return static_cast<int>(code_); }
  const char* name() const { return cudaGetErrorName(code_); }
  const char* file() const { return file_; }
  int line() const { return line_; }

  static std::string describe(cudaError_t code, const char* expr, const char* file, int line) {
    std::ostringstream os;
    os << "CUDA error " << static_cast<int>(code) << " (" << cudaGetErrorName(code) << ": " << cudaGetErrorString(code)
       << ") at " << source_path(file) << ":" << line << " in " << expr;
    return os.str();
  }

 private:
  cudaError_t code_;
  const char* file_;
  int line_;
};

}  // namespace moe_dispatch

// Both variants clear the runtime's last-error slot: the failure is reported once, here, and
// must not resurface in an unrelated later check.
#define MOE_CUDA_CHECK(expr)                                                   \
  do {                                                                         \
    const cudaError_t moe_status_ = (expr);                                    \
    if (moe_status_ != cudaSuccess) {                                          \
      (void)cudaGetLastError();                                                \
      throw ::moe_dispatch::CudaError(moe_status_, #expr, __FILE__, __LINE__); \
    }                                                                          \
  } while (0)

#define MOE_CUDA_CHECK_WARN(expr)                                                                        \
  do {                                                                                                   \
    const cudaError_t moe_status_ = (expr);                                                              \
    if (moe_status_ != cudaSuccess) {                                                                    \
      (void)cudaGetLastError();                                                                          \
      std::fprintf(stderr, "moe_dispatch warning: %s (ignored during teardown)\n",                       \
                   ::moe_dispatch::CudaError::describe(moe_status_, #expr, __FILE__, __LINE__).c_str()); \
    }                                                                                                    \
  } while (0)

// Argument check at the host boundary; `message` is a stream expression naming the argument,
// what was expected and what came, e.g. "num_ranks must be > 0, got " << num_ranks.
#define MOE_HOST_CHECK(cond, message)             \
  do {                                            \
    if (!(cond)) {                                \
      std::ostringstream moe_os_;                 \
      moe_os_ << message;                         \
      throw std::invalid_argument(moe_os_.str()); \
    }                                             \
  } while (0)
