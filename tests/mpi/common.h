// Helpers shared by the MPI tests of dispatch_v2 / combine_v2 (test_dispatch.cc and
// test_dispatch_adversarial.cc).
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "moe_ep/error.h"
#include "moe_ep/tensor.h"

namespace moe_ep::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int s = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &s);
  return s;
}

// splitmix64: portable and seedable, so every rank can build the same global batch. Each test
// file derives its own seeding and value helpers.
struct SplitMix64 {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// The elements of a contiguous tensor.
template <typename T>
std::vector<T> values(const Tensor& t) {
  return std::vector<T>(t.ptr<T>(), t.ptr<T>() + t.numel());
}

// The first n elements of a contiguous tensor. dispatch_v2 leaves the rows of expand_x past the
// valid ones, and assist_info_for_combine past its first 3 * valid entries, unspecified (SPEC
// §1.4: only the first valid rows are meaningful), so the tests compare only that prefix and check
// the shape on its own. n outside [0, numel] is a test failure (and is clamped).
template <typename T>
std::vector<T> values(const Tensor& t, int64_t n) {
  if (n < 0 || n > t.numel()) {
    ADD_FAILURE() << "the first " << n << " elements of a tensor of " << t.numel();
    n = std::clamp<int64_t>(n, 0, t.numel());
  }
  return std::vector<T>(t.ptr<T>(), t.ptr<T>() + n);
}

// The first n elements of v (the reference's side of values(t, n)); n outside [0, v.size()] is a
// test failure (and is clamped).
template <typename T>
std::vector<T> prefix(const std::vector<T>& v, int64_t n) {
  if (n < 0 || n > static_cast<int64_t>(v.size())) {
    ADD_FAILURE() << "the first " << n << " elements of a vector of " << v.size();
    n = std::clamp<int64_t>(n, 0, static_cast<int64_t>(v.size()));
  }
  return std::vector<T>(v.begin(), v.begin() + n);
}

// Runs the collective `call` on this rank (`rank`) and checks what it throws. `bad` < 0: every
// rank throws `kind`; else rank `bad` throws `kind` and the others kRemote naming rank `bad`.
// Every message must contain each of `needles`.
inline void expect_collective_error(const std::function<void()>& call, int rank, int bad,
                                    ErrorKind kind, const std::vector<std::string>& needles) {
  try {
    call();
    ADD_FAILURE() << "no error thrown on rank " << rank;
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (bad < 0 || rank == bad) {
      EXPECT_STREQ(error_kind_name(e.kind()), error_kind_name(kind)) << msg;
    } else {
      EXPECT_EQ(e.kind(), ErrorKind::kRemote) << msg;
      EXPECT_NE(msg.find("rank " + std::to_string(bad) + " failed: "), std::string::npos) << msg;
    }
    for (const std::string& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a moe_ep::Error: " << e.what();
  }
}

}  // namespace moe_ep::test
