#include "client/plan_printer.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint_size.h"
#include "common/dtype.h"
#include "layout/shard_ranges.h"
#include "layout/unit_layout.h"

namespace shardd {
namespace {

using Json = nlohmann::ordered_json;

std::string ScaledUnits(int64_t value, double base,
                        const std::vector<const char*>& units,
                        const char* separator) {
  const bool negative = value < 0;
  // Magnitude as unsigned so INT64_MIN does not overflow.
  const uint64_t magnitude = negative
                                 ? uint64_t{0} - static_cast<uint64_t>(value)
                                 : static_cast<uint64_t>(value);
  if (static_cast<double>(magnitude) < base) {
    return absl::StrCat(value, units[0][0] ? separator : "", units[0]);
  }
  double scaled = static_cast<double>(magnitude);
  size_t unit = 0;
  while (scaled >= base && unit + 1 < units.size()) {
    scaled /= base;
    ++unit;
  }
  return absl::StrFormat("%s%.2f%s%s", negative ? "-" : "", scaled, separator,
                         units[unit]);
}

std::string UnitKindName(v1::UnitKind kind) {
  switch (kind) {
    case v1::UNIT_ROOT:
      return "root";
    case v1::UNIT_LAYER:
      return "layer";
    case v1::UNIT_EXPERTS:
      return "experts";
    case v1::UNIT_DTYPE_ISLAND:
      return "dtype_island";
    case v1::UNIT_FLAT_BUCKET:
      return "flat_bucket";
    default:
      return "unspecified";
  }
}

// The unit's own precision when the planner set one (fp32 islands), else
// the plan's.
const v1::MixedPrecision& UnitPrecision(const v1::ShardingPlan& plan,
                                        const v1::FsdpUnit& unit) {
  if (unit.has_precision() &&
      unit.precision().compute_dtype() != v1::DTYPE_UNSPECIFIED) {
    return unit.precision();
  }
  return plan.precision();
}

int64_t GatheredBytes(const v1::ShardingPlan& plan, const v1::FsdpUnit& unit) {
  return unit.gathered_numel() *
         DTypeBytes(UnitPrecision(plan, unit).compute_dtype());
}

std::string ReshardText(const v1::ReshardPolicy& policy) {
  switch (policy.policy_case()) {
    case v1::ReshardPolicy::kReshard:
      return policy.reshard() ? "yes" : "no";
    case v1::ReshardPolicy::kGroupSize:
      return absl::StrCat("to ", policy.group_size());
    case v1::ReshardPolicy::POLICY_NOT_SET:
      break;
  }
  return "-";
}

Json ReshardJson(const v1::ReshardPolicy& policy) {
  switch (policy.policy_case()) {
    case v1::ReshardPolicy::kReshard:
      return policy.reshard();
    case v1::ReshardPolicy::kGroupSize:
      return policy.group_size();
    case v1::ReshardPolicy::POLICY_NOT_SET:
      break;
  }
  return nullptr;
}

std::string PrefetchText(const v1::FsdpUnit& unit) {
  std::vector<std::string> parts;
  if (unit.forward_prefetch_size() > 0) {
    parts.push_back(
        absl::StrCat("fwd ", absl::StrJoin(unit.forward_prefetch(), ",")));
  }
  if (unit.backward_prefetch_size() > 0) {
    parts.push_back(
        absl::StrCat("bwd ", absl::StrJoin(unit.backward_prefetch(), ",")));
  }
  if (parts.empty()) return "-";
  return absl::StrJoin(parts, " ");
}

std::string PrecisionText(const v1::MixedPrecision& precision) {
  return absl::StrCat("param ", DTypeName(precision.param_dtype()),
                      ", compute ", DTypeName(precision.compute_dtype()),
                      ", reduce ", DTypeName(precision.reduce_dtype()));
}

Json PrecisionJson(const v1::MixedPrecision& precision) {
  Json json = Json::object();
  json["param_dtype"] = DTypeName(precision.param_dtype());
  json["compute_dtype"] = DTypeName(precision.compute_dtype());
  json["reduce_dtype"] = DTypeName(precision.reduce_dtype());
  return json;
}

template <typename Repeated>
Json IntArray(const Repeated& values) {
  Json array = Json::array();
  for (const auto value : values) array.push_back(value);
  return array;
}

// Left-aligned text columns, right-aligned number columns.
class TextTable {
 public:
  explicit TextTable(std::vector<std::pair<std::string, bool>> columns)
      : columns_(std::move(columns)) {
    std::vector<std::string> header;
    for (const auto& column : columns_) header.push_back(column.first);
    AddRow(std::move(header));
  }

  void AddRow(std::vector<std::string> row) {
    rows_.push_back(std::move(row));
    spans_.push_back(false);
  }

  // A row whose last cell runs on, left-aligned, over the remaining columns
  // without widening them.
  void AddSpanningRow(std::vector<std::string> row) {
    rows_.push_back(std::move(row));
    spans_.push_back(true);
  }

  std::string Render(absl::string_view indent) const {
    std::vector<size_t> widths(columns_.size(), 0);
    for (size_t r = 0; r < rows_.size(); ++r) {
      const auto& row = rows_[r];
      const size_t measured =
          spans_[r] && !row.empty() ? row.size() - 1 : row.size();
      for (size_t c = 0; c < measured && c < widths.size(); ++c) {
        widths[c] = std::max(widths[c], row[c].size());
      }
    }
    std::string out;
    for (size_t r = 0; r < rows_.size(); ++r) {
      const auto& row = rows_[r];
      std::string line(indent);
      for (size_t c = 0; c < row.size() && c < widths.size(); ++c) {
        if (c > 0) line += "  ";
        if (spans_[r] && c + 1 == row.size()) {
          line += row[c];
          break;
        }
        const bool right = columns_[c].second;
        const std::string pad(widths[c] - row[c].size(), ' ');
        line += right ? pad + row[c] : row[c] + pad;
      }
      while (!line.empty() && line.back() == ' ') line.pop_back();
      absl::StrAppend(&out, line, "\n");
    }
    return out;
  }

 private:
  std::vector<std::pair<std::string, bool>> columns_;  // (title, right)
  std::vector<std::vector<std::string>> rows_;
  std::vector<bool> spans_;  // One per row: AddSpanningRow.
};

// a - b, clamped to the int64 range (plans from a coordinator are not
// trusted to hold sane values).
int64_t SaturatingSub(int64_t a, int64_t b) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  if (b < 0 && a > kMax + b) return kMax;
  if (b > 0 && a < kMin + b) return kMin;
  return a - b;
}

// "80 GiB" when the size is a whole number of its unit, else HumanBytes
// ("74.51 GiB" for 80 GB).
std::string ShortBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B",   "KiB", "MiB",
                                           "GiB", "TiB", "PiB"};
  if (bytes <= 0) return HumanBytes(bytes);
  int unit = 0;
  int64_t scaled = bytes;
  while (scaled >= 1024 && unit + 1 < 6) {
    scaled /= 1024;
    ++unit;
  }
  const int64_t unit_bytes = int64_t{1} << (10 * unit);
  if (bytes % unit_bytes != 0) return HumanBytes(bytes);
  return absl::StrCat(bytes / unit_bytes, " ", kUnits[unit]);
}

// The verdict after "fits <size>" in the table.
std::string FitText(const v1::ShardingPlan& plan, const PlanFit& fit) {
  const v1::MemoryReport& memory = plan.memory();
  if (fit.fits) {
    return absl::StrCat("yes: ", HumanBytes(memory.peak_total_bytes()), " of ",
                        HumanBytes(fit.device_memory_bytes), ", ",
                        HumanBytes(fit.headroom_bytes),
                        plan.has_activations()
                            ? " left for workspace"
                            : " left for activations and workspace");
  }
  std::string text =
      absl::StrCat("NO: needs ", HumanBytes(memory.peak_total_bytes()), ", ",
                   HumanBytes(SaturatingSub(0, fit.headroom_bytes)), " over; ");
  if (fit.suggested_dp > 0) {
    absl::StrAppend(&text, "fits from about --dp ", fit.suggested_dp,
                    " (estimate: the same units sharded over more ranks)");
  } else if (memory.peak_unsharded_bytes() >= fit.device_memory_bytes) {
    absl::StrAppend(&text,
                    "does not fit at any --dp with this strategy: the "
                    "unsharded peak alone is ",
                    HumanBytes(memory.peak_unsharded_bytes()));
  } else {
    absl::StrAppend(&text, "does not fit at any --dp up to ", kMaxSuggestedDp,
                    " with this strategy (estimate)");
  }
  // Activations do not shrink with more ranks; recomputing trades them for
  // compute.
  if (plan.has_activations() && plan.activations().checkpointing() == "none" &&
      memory.peak_step_activation_bytes() > memory.peak_step_bytes() / 4) {
    absl::StrAppend(&text, "; activations are ",
                    HumanBytes(memory.peak_step_activation_bytes()),
                    " of the peak: --activation-checkpointing all recomputes "
                    "them");
  }
  return text;
}

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

// Elements one rank holds of `unit` when its shard group has `ranks` ranks,
// by the layout laws: FSDP2 pads each parameter's dim 0 to a multiple of
// the ranks (under the "auto" placement a parameter that would pad too much
// is split by elements instead: unit_layout.h); flat buckets pad the unit's
// total. Doubles: the plan may come from elsewhere, and this is only an
// estimate.
double UnitShardNumel(const v1::ShardingPlan& plan, const v1::FsdpUnit& unit,
                      int64_t ranks) {
  if (plan.flat_buckets()) {
    return unit.numel() > 0 ? static_cast<double>(CeilDiv(unit.numel(), ranks))
                            : 0.0;
  }
  const bool by_elements_if_padded = plan.shard_placement() == "auto";
  // An expert-parallel unit is one block over the block's ranks (the same
  // ep at any dp).
  const int64_t blocks = std::max(1, unit.ep());
  const int64_t group = std::max<int64_t>(1, ranks / blocks);
  double total = 0;
  for (const v1::ParamLayout& param : unit.params()) {
    if (param.global_shape_size() == 0 || param.global_shape(0) <= 0) continue;
    std::vector<int64_t> shape = GlobalShape(param);
    shape[0] = std::max<int64_t>(1, shape[0] / blocks);
    if (by_elements_if_padded && DimZeroPadsTooMuch(shape, group)) {
      total += static_cast<double>(CeilDiv(param.numel() / blocks, group));
      continue;
    }
    double row = 1;
    for (size_t d = 1; d < shape.size(); ++d) {
      row *= static_cast<double>(std::max<int64_t>(shape[d], 0));
    }
    total += static_cast<double>(CeilDiv(shape[0], group)) * row;
  }
  return total;
}

// The checkpoint section: what a save writes (replica 0's shard ranks),
// to size the disk (checkpoint/checkpoint_size.h).
std::string CheckpointText(const v1::ShardingPlan& plan) {
  absl::StatusOr<std::vector<checkpoint::CheckpointBytes>> ck =
      checkpoint::PlanCheckpointBytes(plan);
  if (!ck.ok() || ck->empty()) return "";
  const checkpoint::CheckpointBytes sum = checkpoint::SumCheckpointBytes(*ck);
  int64_t largest = 0;
  for (const checkpoint::CheckpointBytes& b : *ck) {
    largest = std::max(largest, b.total());
  }
  std::string out = "\nCheckpoint (one save)\n";
  TextTable t({{"", false}, {"", true}, {"", false}});
  t.AddRow({"per rank", HumanBytes(largest),
            absl::StrCat("largest of ", ck->size(),
                         " shard ranks' files (fp32 params + AdamW moments)")});
  t.AddRow({"total", HumanBytes(sum.total()),
            "all ranks, with optimizer state (resumable)"});
  t.AddRow({"weights only", HumanBytes(sum.without_optimizer()),
            "fp32 parameters alone"});
  std::string text = t.Render("  ");
  text.erase(0, text.find('\n') + 1);
  return out + text;
}

}  // namespace

PlanFit CheckPlanFit(const v1::ShardingPlan& plan,
                     int64_t device_memory_bytes) {
  const v1::MemoryReport& memory = plan.memory();
  PlanFit fit;
  fit.device_memory_bytes = device_memory_bytes;
  fit.fits = memory.peak_total_bytes() <= device_memory_bytes;
  fit.headroom_bytes =
      SaturatingSub(device_memory_bytes, memory.peak_total_bytes());
  if (fit.fits) return fit;
  const int64_t dp = plan.mesh().dp_shard();
  const double persistent = static_cast<double>(memory.persistent_bytes());
  const double unsharded = static_cast<double>(memory.peak_unsharded_bytes());
  const double activations =
      static_cast<double>(memory.peak_activation_bytes());
  if (dp < 1 || persistent < 0 || unsharded < 0) return fit;
  std::vector<double> shard_now;
  double total_now = 0;
  for (const v1::FsdpUnit& unit : plan.units()) {
    shard_now.push_back(UnitShardNumel(plan, unit, dp));
    total_now += shard_now.back();
  }
  for (int64_t n = 2 * dp; n <= kMaxSuggestedDp; n *= 2) {
    double total = 0;
    // Gathered buffers never shrink with more ranks and grow with padding
    // (8 stacked experts over 32 ranks gather 32 rows); every live buffer
    // grows at most by the largest unit's factor, so the peak does too.
    double gather_growth = 1;
    for (int u = 0; u < plan.units_size(); ++u) {
      const double shard = UnitShardNumel(plan, plan.units(u), n);
      total += shard;
      if (shard_now[u] > 0) {
        gather_growth = std::max(gather_growth,
                                 static_cast<double>(n) * shard /
                                     (static_cast<double>(dp) * shard_now[u]));
      }
    }
    // The sharded state shrinks with the elements a rank holds (dp / n
    // without padding); a plan without layouts falls back to dp / n.
    const double state_scale =
        total_now > 0 ? total / total_now
                      : static_cast<double>(dp) / static_cast<double>(n);
    // Activations per rank do not shrink with more ranks (the micro-batch
    // stays); their peak bounds what they add at any point.
    if (persistent * state_scale + unsharded * gather_growth + activations <=
        static_cast<double>(device_memory_bytes)) {
      fit.suggested_dp = static_cast<int32_t>(n);
      break;
    }
  }
  return fit;
}

std::string HumanBytes(int64_t bytes) {
  return ScaledUnits(bytes, 1024.0, {"B", "KiB", "MiB", "GiB", "TiB", "PiB"},
                     " ");
}

std::string HumanCount(int64_t count) {
  return ScaledUnits(count, 1000.0, {"", "K", "M", "B", "T"}, "");
}

std::string FormatPlanTable(const v1::ShardingPlan& plan,
                            const v1::ModelSummary* summary,
                            int64_t device_memory_bytes) {
  std::string out;
  const v1::MeshSpec& mesh = plan.mesh();
  const v1::StepShape& step = plan.step();
  const v1::MemoryReport& memory = plan.memory();
  const v1::CommReport& comm = plan.comm();

  std::string model = plan.architecture();
  if (!plan.model_id().empty())
    absl::StrAppend(&model, " (", plan.model_id(), ")");
  absl::StrAppend(&out, "Model        ", model, "\n");
  std::string params =
      absl::StrCat(HumanCount(plan.total_params()), " parameters");
  if (summary != nullptr) {
    absl::StrAppend(&params, " (trainable ",
                    HumanCount(summary->trainable_params()));
    if (summary->expert_params() > 0) {
      absl::StrAppend(&params, ", routed experts ",
                      HumanCount(summary->expert_params()), ", active ",
                      HumanCount(summary->active_params()), " per token");
    }
    absl::StrAppend(&params, ")");
  }
  absl::StrAppend(&out, "Parameters   ", params, "\n");
  // Parameters the placement split by elements (their dim 0 padded).
  const int element_split = ElementSplitParams(plan);
  absl::StrAppend(
      &out, "Strategy     ", plan.strategy(), ", ", plan.units_size(), " units",
      plan.flat_buckets()
          ? absl::StrCat(" (flat buckets of ",
                         HumanCount(plan.bucket_elements()), " elements)")
          : absl::StrCat(
                ", placement ",
                plan.shard_placement().empty() ? "dim0"
                                               : plan.shard_placement(),
                element_split > 0 ? absl::StrCat(" (", element_split,
                                                 " stacked parameters split by "
                                                 "elements: dim 0 would pad)")
                                  : ""),
      "\n");
  absl::StrAppend(&out, "Mesh         dp_shard ", mesh.dp_shard(),
                  " x dp_replicate ", mesh.dp_replicate(), " (tp ", mesh.tp(),
                  ", cp ", mesh.cp(), "), world size ", plan.world_size(),
                  "\n");
  if (mesh.ep() > 1) {
    const int ep_shard = mesh.dp_shard() / mesh.ep();
    absl::StrAppend(&out, "             experts: ep ", mesh.ep(),
                    " x ep_shard ", ep_shard, ", ", mesh.ep(), " groups of ",
                    ep_shard, ep_shard == 1 ? " rank" : " consecutive ranks",
                    ", each holding 1/", mesh.ep(),
                    " of every layer's routed experts and running the "
                    "tokens routed to them\n");
  }
  absl::StrAppend(&out, "Precision    ", PrecisionText(plan.precision()), "\n");
  absl::StrAppend(&out, "Step         ", step.microbatches(), " micro-batch",
                  step.microbatches() == 1 ? "" : "es", ", ", step.passes(),
                  " pass", step.passes() == 1 ? "" : "es", " (",
                  step.no_grad_passes(), " without grad), gradient sync ",
                  step.defer_grad_sync() ? "deferred to the last micro-batch"
                                         : "every micro-batch",
                  ", prefetch fwd ", step.forward_prefetch_depth(), " / bwd ",
                  step.backward_prefetch_depth(), "\n");
  absl::StrAppend(&out, "Fingerprint  ",
                  absl::StrFormat("%016x", plan.fingerprint()), "\n");

  absl::StrAppend(&out, "\nUnits (nested units come before their parent)\n");
  // The "in" column (enclosing unit) only when some unit is nested.
  bool nested = false;
  for (const v1::FsdpUnit& unit : plan.units()) nested |= unit.parent() >= 0;
  std::vector<std::pair<std::string, bool>> columns = {
      {"#", true}, {"name", false}, {"kind", false}};
  if (nested) columns.push_back({"in", true});
  const bool ep = mesh.ep() > 1;
  std::vector<std::pair<std::string, bool>> more = {{"tensors", true},
                                                    {"numel", true},
                                                    {"shard/rank", true},
                                                    {"gathered", true}};
  if (ep) more.push_back({"over", true});
  more.push_back({"reshard", false});
  more.push_back({"prefetch", false});
  for (auto column : more) columns.push_back(column);
  TextTable units(std::move(columns));
  for (const v1::FsdpUnit& unit : plan.units()) {
    std::vector<std::string> row = {absl::StrCat(unit.index()), unit.name(),
                                    UnitKindName(unit.kind())};
    if (nested) {
      row.push_back(unit.parent() >= 0 ? absl::StrCat(unit.parent()) : "-");
    }
    for (std::string cell :
         {absl::StrCat(unit.params_size()), HumanCount(unit.numel()),
          HumanCount(unit.shard_numel()),
          HumanBytes(GatheredBytes(plan, unit))}) {
      row.push_back(std::move(cell));
    }
    if (ep) {
      row.push_back(unit.ep() > 1 ? absl::StrCat(mesh.dp_shard() / unit.ep(),
                                                 " (1/", unit.ep(), ")")
                                  : absl::StrCat(mesh.dp_shard()));
    }
    row.push_back(ReshardText(unit.reshard_after_forward()));
    row.push_back(PrefetchText(unit));
    units.AddRow(std::move(row));
  }
  absl::StrAppend(&out, units.Render("  "));
  absl::StrAppend(&out,
                  "  (numel: unpadded elements; shard/rank: elements each "
                  "rank holds, padding included; gathered: the all-gather "
                  "buffer in the compute dtype",
                  nested ? "; in: the enclosing unit" : "",
                  ep ? "; over: the ranks a unit is sharded and gathered "
                       "over, (1/N): one expert-parallel block of N"
                     : "",
                  ")\n");

  absl::StrAppend(&out, "\nPer-rank memory\n");
  TextTable mem({{"", false}, {"", true}, {"", false}});
  mem.AddRow({"sharded params", HumanBytes(memory.sharded_param_bytes()),
              absl::StrCat("master shards, ",
                           DTypeName(plan.precision().param_dtype()))});
  mem.AddRow({"sharded grads", HumanBytes(memory.grad_bytes()),
              absl::StrCat(DTypeName(plan.precision().reduce_dtype()))});
  mem.AddRow({"optimizer", HumanBytes(memory.optimizer_bytes()),
              "AdamW exp_avg + exp_avg_sq"});
  if (memory.compute_shard_bytes() > 0) {
    mem.AddRow({"compute shards", HumanBytes(memory.compute_shard_bytes()),
                absl::StrCat(DTypeName(plan.precision().compute_dtype()),
                             " copies of the shards (--keep-compute-shard)")});
  }
  mem.AddRow({"persistent", HumanBytes(memory.persistent_bytes()),
              memory.compute_shard_bytes() > 0
                  ? "params + grads + optimizer + compute shards"
                  : "params + grads + optimizer"});
  mem.AddRow(
      {"peak unsharded", HumanBytes(memory.peak_unsharded_bytes()),
       absl::StrCat("gathered params ", HumanBytes(memory.peak_param_bytes()),
                    " + unsharded grads ",
                    HumanBytes(memory.peak_grad_bytes()))});
  if (plan.has_activations()) {
    const v1::ActivationModel& a = plan.activations();
    mem.AddRow({"activations", HumanBytes(memory.peak_activation_bytes()),
                absl::StrCat(
                    "peak per rank: micro-batch ", a.micro_batch_size(), " x ",
                    a.seq_len(), " tokens, checkpointing ", a.checkpointing(),
                    a.worker_device() == v1::WORKER_DEVICE_CUDA
                        ? absl::StrCat(", GPU worker (",
                                       a.storage_bytes() == 2 ? "bf16" : "fp32",
                                       " activations)")
                        : "",
                    a.ep() > 1 ? absl::StrFormat("; experts over up to %gx the "
                                                 "balanced routed rows "
                                                 "(--ep-capacity-factor)",
                                                 a.ep_capacity_factor())
                               : "")});
    mem.AddRow({"peak in step", HumanBytes(memory.peak_step_bytes()),
                absl::StrCat("unsharded + activations ",
                             HumanBytes(memory.peak_step_activation_bytes()),
                             " at one point")});
    mem.AddRow({"peak total", HumanBytes(memory.peak_total_bytes()),
                "persistent + peak in step"});
  } else {
    mem.AddRow({"peak total", HumanBytes(memory.peak_total_bytes()),
                "persistent + peak unsharded (activations not counted: "
                "--micro-batch-size N --seq N counts them)"});
  }
  if (device_memory_bytes > 0) {
    mem.AddSpanningRow(
        {absl::StrCat("fits ", ShortBytes(device_memory_bytes)),
         FitText(plan, CheckPlanFit(plan, device_memory_bytes))});
  }
  std::string mem_text = mem.Render("  ");
  // Drop the empty header line.
  mem_text.erase(0, mem_text.find('\n') + 1);
  absl::StrAppend(&out, mem_text);
  if (!memory.peak_where().empty()) {
    absl::StrAppend(&out, "  peak at: ", memory.peak_where(), "\n");
  }
  if (plan.has_activations() && !memory.peak_step_where().empty()) {
    absl::StrAppend(&out, "  peak in step at: ", memory.peak_step_where(),
                    "\n");
  }

  absl::StrAppend(&out, CheckpointText(plan));

  absl::StrAppend(&out, "\nPer-step communication (per rank)\n");
  TextTable net({{"", false}, {"", true}, {"", false}});
  net.AddRow({"all-gather", HumanBytes(comm.all_gather_bytes()),
              absl::StrCat("in ", comm.all_gathers(), " collectives")});
  net.AddRow({"reduce-scatter", HumanBytes(comm.reduce_scatter_bytes()),
              absl::StrCat("in ", comm.reduce_scatters(), " collectives")});
  if (comm.all_reduces() > 0 || mesh.dp_replicate() > 1) {
    net.AddRow({"all-reduce", HumanBytes(comm.all_reduce_bytes()),
                absl::StrCat("in ", comm.all_reduces(),
                             " collectives (HSDP replicas)")});
  }
  if (mesh.ep() > 1) {
    net.AddRow({"all-to-all", HumanBytes(comm.all_to_all_bytes()),
                plan.has_activations()
                    ? absl::StrCat("in ", comm.all_to_alls(),
                                   " collectives (expert dispatch and "
                                   "combine, balanced routing)")
                    : "not counted: --micro-batch-size N --seq N counts "
                      "the routed tokens"});
  }
  std::string net_text = net.Render("  ");
  net_text.erase(0, net_text.find('\n') + 1);
  absl::StrAppend(&out, net_text);
  return out;
}

nlohmann::ordered_json PlanToJson(const v1::ShardingPlan& plan,
                                  const v1::ModelSummary* summary,
                                  int64_t device_memory_bytes) {
  Json json = Json::object();
  json["model_id"] = plan.model_id();
  json["architecture"] = plan.architecture();
  json["strategy"] = plan.strategy();
  json["total_params"] = plan.total_params();
  json["world_size"] = plan.world_size();
  if (summary != nullptr) {
    Json model = Json::object();
    model["total_params"] = summary->total_params();
    model["trainable_params"] = summary->trainable_params();
    model["expert_params"] = summary->expert_params();
    model["active_params"] = summary->active_params();
    model["num_param_tensors"] = summary->num_param_tensors();
    json["summary"] = std::move(model);
  }
  Json mesh = Json::object();
  mesh["dp_shard"] = plan.mesh().dp_shard();
  mesh["dp_replicate"] = plan.mesh().dp_replicate();
  mesh["tp"] = plan.mesh().tp();
  mesh["cp"] = plan.mesh().cp();
  mesh["ep"] = std::max(1, plan.mesh().ep());
  mesh["ep_shard"] = plan.mesh().dp_shard() / std::max(1, plan.mesh().ep());
  json["mesh"] = std::move(mesh);
  json["precision"] = PrecisionJson(plan.precision());
  Json step = Json::object();
  step["microbatches"] = plan.step().microbatches();
  step["passes"] = plan.step().passes();
  step["no_grad_passes"] = plan.step().no_grad_passes();
  step["defer_grad_sync"] = plan.step().defer_grad_sync();
  step["forward_prefetch_depth"] = plan.step().forward_prefetch_depth();
  step["backward_prefetch_depth"] = plan.step().backward_prefetch_depth();
  json["step"] = std::move(step);
  json["flat_buckets"] = plan.flat_buckets();
  json["shard_placement"] = plan.shard_placement();
  json["bucket_elements"] = plan.bucket_elements();
  // A string: JSON readers often hold numbers as doubles (53 bits).
  json["fingerprint"] = absl::StrFormat("%016x", plan.fingerprint());

  Json units = Json::array();
  for (const v1::FsdpUnit& unit : plan.units()) {
    Json u = Json::object();
    u["index"] = unit.index();
    u["name"] = unit.name();
    u["kind"] = UnitKindName(unit.kind());
    u["layer_index"] = unit.layer_index();
    u["parent"] = unit.parent();
    u["numel"] = unit.numel();
    u["trainable_numel"] = unit.trainable_numel();
    u["shard_numel"] = unit.shard_numel();
    u["gathered_numel"] = unit.gathered_numel();
    u["gathered_bytes"] = GatheredBytes(plan, unit);
    u["ep"] = std::max(1, unit.ep());
    u["shard_group"] = plan.mesh().dp_shard() / std::max(1, unit.ep());
    u["precision"] = PrecisionJson(UnitPrecision(plan, unit));
    u["reshard_after_forward"] = ReshardJson(unit.reshard_after_forward());
    u["forward_prefetch"] = IntArray(unit.forward_prefetch());
    u["backward_prefetch"] = IntArray(unit.backward_prefetch());
    u["prefetch_target"] = unit.prefetch_target();
    Json params = Json::array();
    for (const v1::ParamLayout& param : unit.params()) {
      Json p = Json::object();
      p["name"] = param.name();
      p["global_shape"] = IntArray(param.global_shape());
      p["dtype"] = DTypeName(param.dtype());
      p["shard_dim"] = param.shard_dim();
      p["row_numel"] = param.row_numel();
      p["padded_dim0"] = param.padded_dim0();
      p["rows_per_rank"] = param.rows_per_rank();
      p["local_shape"] = IntArray(param.local_shape());
      p["local_numel"] = param.local_numel();
      p["numel"] = param.numel();
      p["shard_offset"] = param.shard_offset();
      p["unsharded_offset"] = param.unsharded_offset();
      p["frozen"] = param.frozen();
      if (param.ep_blocks() > 1) p["ep_blocks"] = param.ep_blocks();
      // valid_rows is left out: it is derivable from rows_per_rank and has
      // one entry per rank (large for big worlds).
      // Flat buckets: the span of shard ranks holding the parameter (the
      // per-rank pieces follow from it, see FlatRangesOf in
      // layout/unit_layout.h).
      if (plan.flat_buckets()) {
        p["first_shard_rank"] = param.first_shard_rank();
        p["last_shard_rank"] = param.last_shard_rank();
      }
      params.push_back(std::move(p));
    }
    u["params"] = std::move(params);
    units.push_back(std::move(u));
  }
  json["units"] = std::move(units);

  const v1::MemoryReport& memory = plan.memory();
  Json per_rank = Json::object();
  per_rank["sharded_param_bytes"] = memory.sharded_param_bytes();
  per_rank["grad_bytes"] = memory.grad_bytes();
  per_rank["optimizer_bytes"] = memory.optimizer_bytes();
  per_rank["compute_shard_bytes"] = memory.compute_shard_bytes();
  per_rank["peak_unsharded_bytes"] = memory.peak_unsharded_bytes();
  per_rank["peak_param_bytes"] = memory.peak_param_bytes();
  per_rank["peak_grad_bytes"] = memory.peak_grad_bytes();
  per_rank["peak_where"] = memory.peak_where();
  per_rank["persistent_bytes"] = memory.persistent_bytes();
  per_rank["peak_total_bytes"] = memory.peak_total_bytes();
  per_rank["peak_step_bytes"] = memory.peak_step_bytes();
  if (plan.has_activations()) {
    const v1::ActivationModel& a = plan.activations();
    per_rank["peak_activation_bytes"] = memory.peak_activation_bytes();
    per_rank["peak_step_activation_bytes"] =
        memory.peak_step_activation_bytes();
    per_rank["peak_step_where"] = memory.peak_step_where();
    Json acts = Json::object();
    acts["micro_batch_size"] = a.micro_batch_size();
    acts["seq_len"] = a.seq_len();
    acts["checkpointing"] = a.checkpointing();
    acts["worker_device"] =
        a.worker_device() == v1::WORKER_DEVICE_CUDA ? "cuda" : "cpu";
    acts["storage_bytes"] = a.storage_bytes();
    if (a.ep() > 1) acts["ep_capacity_factor"] = a.ep_capacity_factor();
    Json layers = Json::array();
    for (const v1::LayerActivations& l : a.layers()) {
      Json layer = Json::object();
      layer["layer"] = l.layer();
      layer["saved_bytes"] = l.saved_bytes();
      layer["checkpoint_bytes"] = l.checkpoint_bytes();
      layer["experts_saved_bytes"] = l.experts_saved_bytes();
      if (a.ep() > 1) {
        layer["routed_rows"] = l.routed_rows();
        layer["dispatch_bytes"] = l.dispatch_bytes();
      }
      layer["recompute"] = l.recompute()           ? "layer"
                           : l.recompute_experts() ? "experts"
                                                   : "none";
      layers.push_back(std::move(layer));
    }
    acts["layers"] = std::move(layers);
    json["activations"] = std::move(acts);
  }
  per_rank["timeline_events"] = memory.timeline_events();
  if (memory.timeline_size() > 0) {
    Json timeline = Json::array();
    for (const v1::TimelineEvent& event : memory.timeline()) {
      Json e = Json::object();
      e["microbatch"] = event.microbatch();
      e["pass"] = event.pass();
      e["phase"] = event.phase();
      e["op"] = event.op();
      if (plan.has_activations()) {
        e["live_activation_bytes"] = event.live_activation_bytes();
      }
      e["unit"] = event.unit();
      e["live_param_bytes"] = event.live_param_bytes();
      e["live_grad_bytes"] = event.live_grad_bytes();
      timeline.push_back(std::move(e));
    }
    per_rank["timeline"] = std::move(timeline);
  }
  json["per_rank"] = std::move(per_rank);
  if (absl::StatusOr<std::vector<checkpoint::CheckpointBytes>> ck =
          checkpoint::PlanCheckpointBytes(plan);
      ck.ok() && !ck->empty()) {
    // Files of replica 0's shard ranks (the other replicas write none).
    const checkpoint::CheckpointBytes sum = checkpoint::SumCheckpointBytes(*ck);
    Json c = Json::object();
    Json ranks = Json::array();
    for (const checkpoint::CheckpointBytes& b : *ck) ranks.push_back(b.total());
    c["rank_bytes"] = std::move(ranks);
    c["total_bytes"] = sum.total();
    c["total_bytes_without_optimizer"] = sum.without_optimizer();
    json["checkpoint"] = std::move(c);
  }

  if (device_memory_bytes > 0) {
    const PlanFit fit = CheckPlanFit(plan, device_memory_bytes);
    Json f = Json::object();
    f["device_memory_bytes"] = fit.device_memory_bytes;
    f["fits"] = fit.fits;
    f["headroom_bytes"] = fit.headroom_bytes;
    if (!fit.fits && fit.suggested_dp > 0) f["suggested_dp"] = fit.suggested_dp;
    json["fit"] = std::move(f);
  }

  const v1::CommReport& comm = plan.comm();
  Json c = Json::object();
  c["all_gather_bytes"] = comm.all_gather_bytes();
  c["reduce_scatter_bytes"] = comm.reduce_scatter_bytes();
  c["all_reduce_bytes"] = comm.all_reduce_bytes();
  c["all_gathers"] = comm.all_gathers();
  c["reduce_scatters"] = comm.reduce_scatters();
  c["all_reduces"] = comm.all_reduces();
  c["all_to_all_bytes"] = comm.all_to_all_bytes();
  c["all_to_alls"] = comm.all_to_alls();
  json["comm"] = std::move(c);
  return json;
}

std::string FormatPlanJson(const v1::ShardingPlan& plan,
                           const v1::ModelSummary* summary,
                           int64_t device_memory_bytes) {
  // Replacing invalid UTF-8 keeps dump() from throwing.
  return PlanToJson(plan, summary, device_memory_bytes)
             .dump(2, ' ', /*ensure_ascii=*/false,
                   nlohmann::ordered_json::error_handler_t::replace) +
         "\n";
}

}  // namespace shardd
