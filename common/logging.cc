#include "common/logging.h"

#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>

namespace shardd {
namespace {

LogSeverity InitialSeverity() {
  const char* env = std::getenv("SHARDD_MIN_LOG_LEVEL");
  if (env != nullptr && env[0] >= '0' && env[0] <= '3' && env[1] == '\0') {
    return static_cast<LogSeverity>(env[0] - '0');
  }
  return LogSeverity::kInfo;
}

std::atomic<int> g_min_severity{static_cast<int>(InitialSeverity())};
std::atomic<bool> g_json{false};

const char* Basename(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash == nullptr ? path : slash + 1;
}

void AppendJsonEscaped(std::string* out, const std::string& text) {
  for (char c : text) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\t':
        *out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          *out += c;
        }
    }
  }
}

}  // namespace

void SetMinLogSeverity(LogSeverity severity) {
  g_min_severity.store(static_cast<int>(severity));
}

LogSeverity MinLogSeverity() {
  return static_cast<LogSeverity>(g_min_severity.load());
}

void SetJsonLogging(bool json) { g_json.store(json); }

namespace logging_internal {

LogMessage::LogMessage(const char* file, int line, LogSeverity severity)
    : file_(file), line_(line), severity_(severity) {}

LogMessage::~LogMessage() {
  static const char kLetters[] = {'I', 'W', 'E', 'F'};
  static const char* const kNames[] = {"INFO", "WARNING", "ERROR", "FATAL"};
  const int sev = static_cast<int>(severity_);
  struct timeval tv;
  gettimeofday(&tv, nullptr);
  struct tm tm_buf;
  gmtime_r(&tv.tv_sec, &tm_buf);
  char stamp[64];
  std::string line;
  if (g_json.load()) {
    std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%S", &tm_buf);
    char frac[16];
    std::snprintf(frac, sizeof(frac), ".%06ldZ", static_cast<long>(tv.tv_usec));
    line = std::string("{\"ts\":\"") + stamp + frac + "\",\"level\":\"" +
           kNames[sev] + "\",\"src\":\"" + Basename(file_) + ":" +
           std::to_string(line_) + "\",\"pid\":" + std::to_string(getpid()) +
           ",\"msg\":\"";
    AppendJsonEscaped(&line, stream_.str());
    line += "\"}\n";
  } else {
    std::strftime(stamp, sizeof(stamp), "%m%d %H:%M:%S", &tm_buf);
    char frac[16];
    std::snprintf(frac, sizeof(frac), ".%06ld", static_cast<long>(tv.tv_usec));
    line = std::string(1, kLetters[sev]) + stamp + frac + " " +
           Basename(file_) + ":" + std::to_string(line_) + "] " +
           stream_.str() + "\n";
  }
  // One write per line keeps lines from interleaving across threads.
  std::fwrite(line.data(), 1, line.size(), stderr);
  if (severity_ == LogSeverity::kFatal) {
    std::fflush(stderr);
    std::abort();
  }
}

}  // namespace logging_internal
}  // namespace shardd
