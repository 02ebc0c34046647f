// A minimal NVTX tool for nccl_nvtx_test: NVTX3 dlopen()s it from NVTX_INJECTION64_PATH
// at the first NVTX call of the process and calls InitializeInjectionNvtx2, which installs
// handlers for the domain calls comm makes. Each handler records one line
//
//   create <domain>
//   push <domain>|<message>|<payload>          pop <domain>
//   start <domain>|<message>|<payload> #<id>   end <domain> #<id>
//
// which the test reads back through comm_nvtx_test_events() (dlopen of the same path with
// RTLD_NOLOAD: a null handle means NVTX never loaded this tool).
#include <nvtx3/nvToolsExt.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace {

std::mutex mu;
std::vector<std::string> events;  // under mu
std::string joined;               // under mu: what comm_nvtx_test_events() returned last
std::uint64_t next_id = 0;        // under mu
thread_local int depth = 0;

void record(std::string line) {
  std::lock_guard lock(mu);
  events.push_back(std::move(line));
}

std::string domain_name(nvtxDomainHandle_t d) {
  return d == nullptr ? std::string("(default)") : *reinterpret_cast<const std::string*>(d);
}

std::string describe(const nvtxEventAttributes_t* a) {
  if (a == nullptr) return "(null)|";
  std::string s = a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii != nullptr ? a->message.ascii
                                                                                             : "(non-ascii)";
  s += '|';
  if (a->payloadType == NVTX_PAYLOAD_TYPE_UNSIGNED_INT64) s += std::to_string(a->payload.ullValue);
  return s;
}

nvtxDomainHandle_t NVTX_API domain_create(const char* name) {
  record("create " + std::string(name != nullptr ? name : "(null)"));
  return reinterpret_cast<nvtxDomainHandle_t>(new std::string(name != nullptr ? name : ""));  // lives on
}

int NVTX_API push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
  record("push " + domain_name(d) + "|" + describe(a));
  return depth++;
}

int NVTX_API pop(nvtxDomainHandle_t d) {
  record("pop " + domain_name(d));
  return depth > 0 ? --depth : -1;
}

nvtxRangeId_t NVTX_API start(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
  std::lock_guard lock(mu);
  const std::uint64_t id = ++next_id;
  events.push_back("start " + domain_name(d) + "|" + describe(a) + " #" + std::to_string(id));
  return id;
}

void NVTX_API end(nvtxDomainHandle_t d, nvtxRangeId_t id) { record("end " + domain_name(d) + " #" + std::to_string(id)); }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get_export_table(NVTX_ETID_CALLBACKS));
  if (callbacks == nullptr || callbacks->GetModuleFunctionTable == nullptr) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size) == 0 || table == nullptr) return 0;
  const auto set = [&](unsigned int id, NvtxFunctionPointer fn) {
    if (id < size && table[id] != nullptr) *table[id] = fn;
  };
  set(NVTX_CBID_CORE2_DomainCreateA, reinterpret_cast<NvtxFunctionPointer>(&domain_create));
  set(NVTX_CBID_CORE2_DomainRangePushEx, reinterpret_cast<NvtxFunctionPointer>(&push));
  set(NVTX_CBID_CORE2_DomainRangePop, reinterpret_cast<NvtxFunctionPointer>(&pop));
  set(NVTX_CBID_CORE2_DomainRangeStartEx, reinterpret_cast<NvtxFunctionPointer>(&start));
  set(NVTX_CBID_CORE2_DomainRangeEnd, reinterpret_cast<NvtxFunctionPointer>(&end));
  record("init");
  return 1;
}

/// Every event so far, one per line (valid until the next call).
__attribute__((visibility("default"))) const char* comm_nvtx_test_events() {
  std::lock_guard lock(mu);
  joined.clear();
  for (const auto& e : events) joined += e + "\n";
  return joined.c_str();
}

/// Forgets the events so far.
__attribute__((visibility("default"))) void comm_nvtx_test_clear() {
  std::lock_guard lock(mu);
  events.clear();
}

}  // extern "C"
