#ifndef SHARDD_COMMON_LOGGING_H_
#define SHARDD_COMMON_LOGGING_H_

// Minimal leveled logging (this Abseil has no absl/log). Lines go to stderr as
//   I1122 01:02:03.456789 server.cc:42] message
// or, with SetJsonLogging(true), as one JSON object per line.
//
//   SHARDD_LOG(INFO) << "listening on " << address;
//   SHARDD_CHECK(ptr != nullptr) << "why";   // aborts: programmer errors only

#include <sstream>
#include <string>

namespace shardd {

enum class LogSeverity { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Messages below this severity are dropped. Default kInfo; the environment
// variable SHARDD_MIN_LOG_LEVEL (0-3) overrides it at start.
void SetMinLogSeverity(LogSeverity severity);
LogSeverity MinLogSeverity();
void SetJsonLogging(bool json);

namespace logging_internal {

class LogMessage {
 public:
  LogMessage(const char* file, int line, LogSeverity severity);
  ~LogMessage();
  LogMessage(const LogMessage&) = delete;
  LogMessage& operator=(const LogMessage&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  const char* file_;
  int line_;
  LogSeverity severity_;
  std::ostringstream stream_;
};

// Swallows the stream expression when a message is disabled.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace logging_internal
}  // namespace shardd

#define SHARDD_LOG_SEVERITY_INFO ::shardd::LogSeverity::kInfo
#define SHARDD_LOG_SEVERITY_WARNING ::shardd::LogSeverity::kWarning
#define SHARDD_LOG_SEVERITY_ERROR ::shardd::LogSeverity::kError
#define SHARDD_LOG_SEVERITY_FATAL ::shardd::LogSeverity::kFatal

#define SHARDD_LOG(severity)                                        \
  !(SHARDD_LOG_SEVERITY_##severity >= ::shardd::MinLogSeverity())   \
      ? (void)0                                                     \
      : ::shardd::logging_internal::Voidify() &                     \
            ::shardd::logging_internal::LogMessage(                 \
                __FILE__, __LINE__, SHARDD_LOG_SEVERITY_##severity) \
                .stream()

#define SHARDD_CHECK(cond)                                            \
  (cond) ? (void)0                                                    \
         : ::shardd::logging_internal::Voidify() &                    \
               ::shardd::logging_internal::LogMessage(                \
                   __FILE__, __LINE__, ::shardd::LogSeverity::kFatal) \
                       .stream()                                      \
                   << "Check failed: " #cond " "

#endif  // SHARDD_COMMON_LOGGING_H_
