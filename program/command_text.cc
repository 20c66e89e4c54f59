#include "program/command_text.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace shardd {

using v1::Command;

std::string CommandToString(const Command& command) {
  const std::string op_name = Command::Op_IsValid(command.op())
                                  ? Command::Op_Name(command.op())
                                  : absl::StrCat("OP(", command.op(), ")");
  switch (command.op()) {
    case Command::UNSHARD:
      return absl::StrCat(op_name, " u", command.unit(),
                          command.prefetch() ? " prefetch" : "");
    case Command::RESHARD:
      return command.group_size() != 0
                 ? absl::StrCat(op_name, " u", command.unit(), " group ",
                                command.group_size())
                 : absl::StrCat(op_name, " u", command.unit());
    case Command::WAIT_UNSHARD:
    case Command::ALLOC_GRAD:
    case Command::REDUCE_SCATTER:
      return absl::StrCat(op_name, " u", command.unit());
    case Command::FORWARD:
    case Command::BACKWARD: {
      const std::string part = Command::Part_IsValid(command.part())
                                   ? Command::Part_Name(command.part())
                                   : absl::StrCat("PART(", command.part(), ")");
      std::string out = absl::StrCat(op_name, " ", part);
      if (command.part() == Command::LAYER ||
          command.part() == Command::EXPERTS ||
          command.part() == Command::DISPATCH ||
          command.part() == Command::COMBINE || command.layer() != -1) {
        absl::StrAppend(&out, " l", command.layer());
      }
      absl::StrAppend(&out, " p", command.pass(), " m", command.microbatch());
      if (command.op() == Command::FORWARD && !command.requires_grad()) {
        absl::StrAppend(&out, " no_grad");
      }
      return out;
    }
    default:
      return op_name;
  }
}

}  // namespace shardd
