#ifndef SHARDD_COMMON_STATUS_MACROS_H_
#define SHARDD_COMMON_STATUS_MACROS_H_

// Abseil 20220623 ships no status macros; these are the project's own.

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SHARDD_STATUS_CONCAT_INNER_(a, b) a##b
#define SHARDD_STATUS_CONCAT_(a, b) SHARDD_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define SHARDD_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status shardd_status_ = (expr);          \
    if (!shardd_status_.ok()) return shardd_status_; \
  } while (0)

// `lhs = value of expr`, returning the error if `expr` (an absl::StatusOr)
// failed. `lhs` may be a declaration: SHARDD_ASSIGN_OR_RETURN(auto x, F());
#define SHARDD_ASSIGN_OR_RETURN(lhs, expr) \
  SHARDD_ASSIGN_OR_RETURN_IMPL_(           \
      SHARDD_STATUS_CONCAT_(shardd_statusor_, __LINE__), lhs, expr)

#define SHARDD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // SHARDD_COMMON_STATUS_MACROS_H_
