// A straight-line program of dispatcher calls: a finished FX graph run from C++, one boxed
// dispatcher call per node, with no Python between them.
//
// Why: a batch-1 decode step of smollm2 is ~1,300 graph nodes, most of them views, reshapes, size
// reads and small kernels. Run from the graph's Python ``forward`` each costs 1-3 us of interpreter
// and argument parsing before its kernel starts; here a node costs the dispatcher's boxed call.
// The program calls the same operators with the same arguments in the same order as the graph, so
// results are bitwise the same (workbench/runtime/step_program.py builds it and says which graphs
// it takes).
//
// Values live in numbered slots: the graph's inputs first, then every node's results. An argument
// is a constant (a weight, an int, a float, None...), a slot, an int list some of whose entries
// are slots (``reshape(x, [s0, 1, 576])``), or a list of tensor slots (``cat([a, b])``). Each
// instruction frees the slots whose last reader it is, as the FX forward sets them to None.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <ATen/ScalarOps.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <utility>
#include <vector>

namespace {

enum ArgKind : int64_t { kConst = 0, kSlot = 1, kIntList = 2, kTensorList = 3, kOptionalTensorList = 4 };
enum InstrKind : int64_t { kCall = 0, kGetItem = 1, kSize = 2 };

struct Arg {
  int64_t kind = kConst;
  c10::IValue value;                                 // kConst: the value; kIntList: the constant entries
  int64_t slot = -1;                                 // kSlot
  std::vector<std::pair<int64_t, int64_t>> patches;  // kIntList: (entry, slot); kTensorList: (entry, slot or -1)
};

struct Instr {
  int64_t kind = kCall;
  c10::optional<c10::OperatorHandle> op;  // kCall
  std::vector<Arg> args;
  int64_t src = -1, index = 0;  // kGetItem: element `index` of slot `src`; kSize: size(index) of `src`
  std::vector<int64_t> outs, frees;
  std::string node;  // the graph node it runs, named in errors
};

// int[] / SymInt[] (optional or not) in a schema: the constant list must be an IntList for unboxing
bool is_int_list(const c10::TypePtr& type) {
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  auto list = t->cast<c10::ListType>();
  if (!list) return false;
  auto kind = list->getElementType()->kind();
  return kind == c10::TypeKind::IntType || kind == c10::TypeKind::SymIntType;
}

c10::IValue typed_constant(const c10::IValue& value, const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType && (value.isDouble() || value.isInt() || value.isBool())) {
    // ``aten.mul.Tensor(x, 1.0)``: Python's argument parser turns the number into a wrapped-number
    // tensor, which type promotion treats as a Python scalar; a boxed call must pass the same
    at::Tensor t = at::scalar_to_tensor(value.toScalar());
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }
  if (!value.isList()) return value;
  c10::TypePtr t = type;
  if (auto opt = t->cast<c10::OptionalType>()) t = opt->getElementType();
  auto list = t->cast<c10::ListType>();
  TORCH_CHECK(list, "a list constant for an argument of type ", type->str());
  auto elem = list->getElementType()->kind();
  auto items = value.toList();
  if (elem == c10::TypeKind::IntType || elem == c10::TypeKind::SymIntType) {
    c10::List<int64_t> out;
    for (const c10::IValue& v : items) out.push_back(v.toInt());
    return out;
  }
  if (elem == c10::TypeKind::FloatType) {
    c10::List<double> out;
    for (const c10::IValue& v : items) out.push_back(v.toDouble());
    return out;
  }
  if (elem == c10::TypeKind::BoolType) {
    c10::List<bool> out;
    for (const c10::IValue& v : items) out.push_back(v.toBool());
    return out;
  }
  if (elem == c10::TypeKind::TensorType) {
    c10::List<at::Tensor> out;
    for (const c10::IValue& v : items) out.push_back(v.toTensor());
    return out;
  }
  TORCH_CHECK(false, "constant list of ", list->getElementType()->str(), " is not supported");
}

struct StepProgram : torch::CustomClassHolder {
  int64_t num_slots;
  std::vector<int64_t> input_slots, output_slots;
  std::vector<std::pair<int64_t, c10::IValue>> preset;  // slots holding a constant from the start
  std::vector<Instr> program;
  std::vector<Arg> pending;  // arguments of the instruction being added

  explicit StepProgram(int64_t slots) : num_slots(slots) {}

  void set_io(std::vector<int64_t> inputs, std::vector<int64_t> outputs) {
    input_slots = std::move(inputs);
    output_slots = std::move(outputs);
  }

  // a weight read inside a list argument (``cat([weight, x])``): it gets a slot, set at each run's start
  void preset_slot(int64_t slot, c10::IValue value) { preset.emplace_back(slot, std::move(value)); }

  void add_const(c10::IValue value) {
    Arg a;
    a.kind = kConst;
    a.value = std::move(value);
    pending.push_back(std::move(a));
  }
  void add_slot(int64_t slot) {
    Arg a;
    a.kind = kSlot;
    a.slot = slot;
    pending.push_back(std::move(a));
  }
  // entries: the list with 0 where a slot goes; patches: flat (entry, slot) pairs
  void add_int_list(std::vector<int64_t> entries, std::vector<int64_t> patches) {
    Arg a;
    a.kind = kIntList;
    a.value = c10::List<int64_t>(entries);
    for (size_t i = 0; i + 1 < patches.size(); i += 2) a.patches.emplace_back(patches[i], patches[i + 1]);
    pending.push_back(std::move(a));
  }
  // slots of a Tensor[] (optional: Tensor?[], where -1 is None)
  void add_tensor_list(std::vector<int64_t> slots, bool optional) {
    Arg a;
    a.kind = optional ? kOptionalTensorList : kTensorList;
    for (size_t i = 0; i < slots.size(); ++i) a.patches.emplace_back(static_cast<int64_t>(i), slots[i]);
    pending.push_back(std::move(a));
  }

  void add_call(const std::string& node, const std::string& name, const std::string& overload,
                std::vector<int64_t> outs, std::vector<int64_t> frees) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    TORCH_CHECK(pending.size() == schema.arguments().size(), name, ".", overload, ": ", pending.size(),
                " arguments given, the schema has ", schema.arguments().size());
    TORCH_CHECK(outs.size() == schema.returns().size(), name, ".", overload, ": ", outs.size(),
                " result slots given, the schema returns ", schema.returns().size());
    for (size_t i = 0; i < pending.size(); ++i) {
      const auto& type = schema.arguments()[i].type();
      if (pending[i].kind == kConst) pending[i].value = typed_constant(pending[i].value, type);
      if (pending[i].kind == kIntList)
        TORCH_CHECK(is_int_list(type), name, ": an int list given for argument ", schema.arguments()[i].name(),
                    " of type ", type->str());
    }
    Instr ins;
    ins.kind = kCall;
    ins.op = op;
    ins.args = std::move(pending);
    pending.clear();
    ins.outs = std::move(outs);
    ins.frees = std::move(frees);
    ins.node = node;
    program.push_back(std::move(ins));
  }

  void add_getitem(int64_t src, int64_t index, int64_t out, std::vector<int64_t> frees) {
    add_builtin(kGetItem, src, index, out, std::move(frees));
  }

  void add_size(int64_t src, int64_t dim, int64_t out, std::vector<int64_t> frees) {
    add_builtin(kSize, src, dim, out, std::move(frees));
  }

  int64_t size() const { return static_cast<int64_t>(program.size()); }

 private:
  // kGetItem: element ``index`` of slot ``src``; kSize: ``src.size(index)``; into slot ``out``
  void add_builtin(int64_t kind, int64_t src, int64_t index, int64_t out, std::vector<int64_t> frees) {
    Instr ins;
    ins.kind = kind;
    ins.src = src;
    ins.index = index;
    ins.outs = {out};
    ins.frees = std::move(frees);
    program.push_back(std::move(ins));
  }

 public:

  std::vector<at::Tensor> run(std::vector<c10::IValue> inputs) const {
    TORCH_CHECK(inputs.size() == input_slots.size(), "the step program takes ", input_slots.size(),
                " inputs, got ", inputs.size());
    std::vector<c10::IValue> slots(num_slots);
    for (size_t i = 0; i < inputs.size(); ++i) slots[input_slots[i]] = std::move(inputs[i]);
    for (const auto& p : preset) slots[p.first] = p.second;
    torch::jit::Stack stack;
    stack.reserve(16);
    for (const Instr& ins : program) {
      switch (ins.kind) {
        case kCall: {
          stack.clear();
          for (const Arg& a : ins.args) {
            switch (a.kind) {
              case kConst: stack.push_back(a.value); break;
              case kSlot: stack.push_back(slots[a.slot]); break;
              case kIntList: {
                c10::List<int64_t> list = a.value.toIntList().copy();
                for (const auto& p : a.patches) list.set(p.first, slots[p.second].toInt());
                stack.emplace_back(std::move(list));
                break;
              }
              case kTensorList: {
                c10::List<at::Tensor> list;
                list.reserve(a.patches.size());
                for (const auto& p : a.patches) list.push_back(slots[p.second].toTensor());
                stack.emplace_back(std::move(list));
                break;
              }
              default: {
                c10::List<c10::optional<at::Tensor>> list;
                list.reserve(a.patches.size());
                for (const auto& p : a.patches)
                  list.push_back(p.second < 0 ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(slots[p.second].toTensor()));
                stack.emplace_back(std::move(list));
              }
            }
          }
          try {
            ins.op->callBoxed(stack);
          } catch (c10::Error& e) {  // the same error type (IndexError stays IndexError), with the node
            e.add_context("in the step program, at graph node " + ins.node + " (" + ins.op->schema().name() + ")");
            throw;
          }
          for (size_t i = 0; i < ins.outs.size(); ++i) slots[ins.outs[i]] = std::move(stack[i]);
          break;
        }
        case kGetItem: {
          const c10::IValue& v = slots[ins.src];
          slots[ins.outs[0]] = v.isTuple() ? v.toTupleRef().elements()[ins.index] : v.toListRef()[ins.index];
          break;
        }
        default:
          slots[ins.outs[0]] = slots[ins.src].toTensor().size(ins.index);
      }
      for (int64_t f : ins.frees) slots[f] = c10::IValue();
    }
    std::vector<at::Tensor> out;
    out.reserve(output_slots.size());
    for (int64_t s : output_slots) out.push_back(slots[s].toTensor());
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(workbench, m) {
  m.class_<StepProgram>("StepProgram")
      .def(torch::init<int64_t>())
      .def("set_io", &StepProgram::set_io)
      .def("preset_slot", &StepProgram::preset_slot)
      .def("add_const", &StepProgram::add_const)
      .def("add_slot", &StepProgram::add_slot)
      .def("add_int_list", &StepProgram::add_int_list)
      .def("add_tensor_list", &StepProgram::add_tensor_list)
      .def("add_call", &StepProgram::add_call)
      .def("add_getitem", &StepProgram::add_getitem)
      .def("add_size", &StepProgram::add_size)
      .def("size", &StepProgram::size)
      .def("run", &StepProgram::run);
}
