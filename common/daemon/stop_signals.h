#ifndef SHARDD_COMMON_DAEMON_STOP_SIGNALS_H_
#define SHARDD_COMMON_DAEMON_STOP_SIGNALS_H_

// How a shardd daemon waits for the end: SIGTERM or SIGINT, or a stop the
// daemon requests itself (an RPC asked it to), without a signal handler and
// without polling.

namespace shardd {

// Blocks SIGTERM and SIGINT in the calling thread. Call it in main before
// any thread starts, so every thread inherits the mask and only
// WaitForStopSignal receives them. Also ignores SIGPIPE: a write to a peer
// that died must fail with EPIPE, not kill the process.
void BlockStopSignals();

// Waits until SIGTERM or SIGINT is pending (after BlockStopSignals) and
// returns its number.
int WaitForStopSignal();

// Makes WaitForStopSignal return (sends SIGTERM to this process). Safe from
// any thread.
void RequestStop();

}  // namespace shardd

#endif  // SHARDD_COMMON_DAEMON_STOP_SIGNALS_H_
