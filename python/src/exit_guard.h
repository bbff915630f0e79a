// The bounded exit after a communication fault (docs/errors.md, "After an error"): once a rank
// has seen a Timeout or System error, MPI_Finalize at interpreter exit may wait for a
// peer that is stalled or gone (a PMIx fence over every process of the job), forever. The guard
// ends the process when exit takes longer than a grace period; mpirun then ends the job.
#pragma once

#include <string>

namespace moe_ep_python {

// Records the first fault (the ErrorKind's name and the message); later faults keep the first.
// Thread-safe, called from the exception translator.
void note_fault(const char* kind, const std::string& message);

// Called at interpreter exit, before MPI is finalised. With no fault recorded: returns -1 and does
// nothing. Otherwise starts a detached thread that, if the process still runs after the grace
// period ($MOE_EP_EXIT_GRACE_S, seconds, > 0 and <= 86400, default 2; a malformed value is
// reported on stderr and the default used), writes one line to stderr naming the first fault and
// calls _exit(1). Returns the grace period in seconds.
double arm_exit_guard();

// The end of a process whose Python died on an uncaught exception (moe_ep's sys.excepthook,
// python/moe_ep/__init__.py): its MPI_Finalize at exit would wait for the other ranks, which
// wait for it (a collective it never joins) until their deadline. When MPI is initialised, not
// finalised, and MPI_COMM_WORLD has more than one process: writes one line to stderr naming this
// rank and `what` (the exception's type), then calls MPI_Abort(MPI_COMM_WORLD, 1), which ends
// every process of the job (does not return). Otherwise returns false and does nothing.
bool abort_job(const std::string& what);

}  // namespace moe_ep_python
