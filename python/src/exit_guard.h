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

}  // namespace moe_ep_python
