// Internal: how this rank moves rows to and from one peer, the interface of the transports. An
// op's steps (src/core/ep) decide which rows go where; a Link carries them as bytes, offsets and
// tags (nothing here names MPI):
//   - MessageLink (transport/mpi/link.h): rows travel as MPI messages. put_block posts a send of
//     one contiguous block, get_block the receive of one; nothing of the peer is addressable.
//   - WindowLink (transport/shm/link.h): the peer is on this machine and its rows live in its
//     shared-memory window (transport/windows.h). place() gives their address in this process; the
//     writer stores them there itself, or the reader loads them where they lie, and put_block /
//     get_block post nothing. A count message (announce / expect_announce, then acquire) orders the
//     stores before the loads.
// Small control messages (headers, counts, "done") travel the same way on every link: post /
// expect. Everything posted goes into an Exchange (transport/exchange.h), whose wait() has the
// communicator's deadline and names the peers still pending when it expires.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include "transport/exchange.h"

namespace moe_ep::detail {

class Link {
 public:
  explicit Link(int peer) : peer_(peer) {}
  virtual ~Link() = default;
  Link(const Link&) = delete;
  Link& operator=(const Link&) = delete;

  // The peer's rank in the communicator.
  int peer() const { return peer_; }
  // True when this rank stores the peer's rows into (or loads them from) the peer's memory.
  virtual bool addressable() const = 0;
  // The address, in this process, of bytes [offset, offset + bytes) of the peer's window segment
  // of generation `gen` (addressable links; Error(kInternal) when outside it, or on a message
  // link).
  virtual char* place(int gen, int64_t offset, int64_t bytes) const = 0;
  // One block of `rows` rows of `row_bytes` bytes at `data` (each <= INT32_MAX): a message link
  // posts its send (put) or its receive (get); an addressable link posts nothing.
  virtual void put_block(Exchange& ex, const void* data, int64_t rows, int64_t row_bytes,
                         int tag) const = 0;
  virtual void get_block(Exchange& ex, void* data, int64_t rows, int64_t row_bytes,
                         int tag) const = 0;
  // After this rank's stores into the peer's memory (addressable links): `*count` (which must
  // stay alive until ex.wait() returns) tells the peer they are there; the peer posts
  // expect_announce. Nothing on a message link, whose messages announce themselves.
  virtual void announce(Exchange& ex, const int64_t* count, int tag) const = 0;
  virtual void expect_announce(Exchange& ex, int64_t* count, int tag) const = 0;
  // After the wait for an announcement (or any message that says the peer's stores are done):
  // makes them visible to this rank's loads. Nothing on a message link.
  virtual void acquire() const {}

  // A small control message of `count` objects of T, the same on every link.
  template <class T>
  void post(Exchange& ex, const T* data, int64_t count, int tag) const {
    ex.isend_n(data, count, peer_, tag);
  }
  template <class T>
  void expect(Exchange& ex, T* data, int64_t count, int tag) const {
    ex.irecv_n(data, count, peer_, tag);
  }

 private:
  int peer_;
};

// The message links of `comm` (transport/mpi), one per rank (itself included), created on first
// use and kept with the communicator.
const std::vector<std::unique_ptr<Link>>& message_links(const Communicator& comm);

}  // namespace moe_ep::detail
