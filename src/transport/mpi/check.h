// Internal to the MPI-based transports (transport/mpi, transport/shm): MPI return codes as Errors.
#pragma once

namespace moe_ep::detail {

// Throws Error(kSystem) "<op>: <what> failed: <MPI_Error_string>" unless rc == MPI_SUCCESS.
void check_mpi(int rc, const char* op, const char* what);

}  // namespace moe_ep::detail
