#ifndef SHARDD_PROGRAM_STEP_BOUNDS_H_
#define SHARDD_PROGRAM_STEP_BOUNDS_H_

namespace shardd {

// Bounds on a step shape; they keep programs (and timelines) bounded.
inline constexpr int kMaxMicrobatches = 1024;
inline constexpr int kMaxPasses = 16;
inline constexpr int kMaxPrefetchDepth = 64;
// At most this many events are stored when the timeline is requested; all
// of them are still counted in timeline_events and searched for the peak.
inline constexpr int kMaxTimelineEvents = 1 << 20;
// Largest program CompileStepProgram materializes (a huge step shape times
// a deep model). ModelStep streams instead and has no such limit.
inline constexpr int kMaxProgramCommands = 1 << 23;

}  // namespace shardd

#endif  // SHARDD_PROGRAM_STEP_BOUNDS_H_
